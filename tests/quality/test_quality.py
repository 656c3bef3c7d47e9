"""Data quality: spec validation of expectations, built-in checks, GX runs on Spark over
Delta sinks, reports (safe paths, retention, offline Data Docs), gates and the CLI.

The end-to-end test runs the real demo pipeline (real nats-server, available-now)
so a clean sink passes, then injects bad data with deltalake and checks the report
names exactly those failures with their counts.
"""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from typer.testing import CliRunner

from isbflow.isb import ledger
from isbflow.quality import checks, docs, reports
from isbflow.quality.run import dead_letter_ids, expected_schema, run_quality
from isbflow.quality.verify import verify_table
from isbflow.spec import SpecError, load_specs
from isbflow.spec.expectations import build_catalog, catalog, check_expectations
from isbflow.steps.runner import PipelineRunner
from tests.conftest import ROOT

LOGS = ROOT / "pipelines" / "logs.yaml"


# ------------------------------------------------------------------ spec


def _spec_with_quality(tmp_path: Path, quality_yaml: str) -> Path:
    text = LOGS.read_text()
    text = text[: text.index("  # Data quality")] + quality_yaml
    p = tmp_path / "spec.yaml"
    p.write_text(text)
    return p


def test_spec_rejects_unknown_expectation_and_wrong_arguments_with_file_and_field(tmp_path):
    path = _spec_with_quality(tmp_path, """  quality:
    - sink: raw
      expectations:
        - expectation: expect_column_values_to_not_be_nul
          kwargs: {column: service}
        - expectation: expect_column_values_to_be_between
          kwargs: {colum: latency_ms, min_value: 0}
        - expectation: expect_column_values_to_be_unique
          kwargs: {}
    - sink: raw
""")
    with pytest.raises(SpecError) as e:
        load_specs(path)
    lines = str(e.value).splitlines()
    assert any(line.startswith(f"{path}: quality[0].expectations[0].expectation: unknown GX expectation "
                               "'expect_column_values_to_not_be_nul' (did you mean "
                               "'expect_column_values_to_not_be_null'?)") for line in lines), lines
    assert any(f"{path}: quality[0].expectations[1].kwargs: colum: not an argument of "
               "expect_column_values_to_be_between (did you mean 'column'?)" in line for line in lines), lines
    assert any("quality[0].expectations[1].kwargs" in line and "column: required" in line for line in lines)
    assert any("quality[0].expectations[2].kwargs: column: required by expect_column_values_to_be_unique"
               in line for line in lines), lines
    assert any("quality[1].sink: sink 'raw' already has a quality entry" in line for line in lines), lines


def test_quality_check_constructs_expectations_and_locates_bad_values(tmp_path):
    path = _spec_with_quality(tmp_path, """  quality:
    - sink: raw
      expectations:
        - expectation: expect_column_values_to_be_between
          kwargs: {column: latency_ms, min_value: 0, mostly: 2}
        - expectation: expect_column_values_to_not_be_null
          kwargs: {column: host}
""")
    problems = check_expectations(load_specs(path))  # names and argument names pass the catalog
    assert [(p.file, p.path) for p in problems] == [(str(path), "quality[0].expectations[0].kwargs.mostly")]
    assert "less than or equal to 1" in problems[0].message
    assert check_expectations(load_specs(LOGS)) == []
    result = CliRunner().invoke(_cli(), ["quality", "check", "-f", str(path)])
    assert result.exit_code == 2 and "kwargs.mostly" in result.output


def test_catalog_matches_installed_gx():
    assert catalog() == build_catalog()


def _cli():
    from isbflow.cli import app

    return app


# ------------------------------------------------------------------ reports


def test_report_path_refuses_paths_leaving_the_reports_folder(tmp_path):
    root = reports.reports_root(tmp_path).resolve()
    assert reports.report_path(tmp_path, "logs", "raw", "x.json") == root / "logs" / "raw" / "x.json"
    assert reports.report_path(tmp_path, "_static/styles/a.css") == root / "_static" / "styles" / "a.css"
    for bad in ["..", "../x", "logs/../../x", "/etc/passwd", "%2e%2e", "%2e%2e%2fx", "%252e%252e%252f",
                "..%2fx", "a\\..\\b", "a%00b", "C:x", "", "./x", "a//b"]:
        with pytest.raises(reports.UnsafeReportPath):
            reports.report_path(tmp_path, "logs", bad)
    (root / "logs").mkdir(parents=True)
    (root / "logs" / "out").symlink_to(tmp_path)
    with pytest.raises(reports.UnsafeReportPath):
        reports.report_path(tmp_path, "logs", "out", "x")


def test_retention_prunes_by_count_and_age_and_says_so(tmp_path, caplog):
    now = datetime(2025, 3, 1, tzinfo=UTC)
    ids = []
    for days in (40, 10, 3, 2, 1):
        rid = reports.new_run_id(now - timedelta(days=days))
        ids.append(rid)
        reports.save_report(tmp_path, {"pipeline": "logs", "sink": "raw", "run_id": rid, "success": True}, "<p>")
    with caplog.at_level("INFO", logger="isbflow.quality.reports"):
        pruned = reports.prune(tmp_path, "logs", "raw", keep_runs=3, max_age=30 * 86400, now=now, protect=ids[-1])
    assert sorted(pruned) == sorted(ids[:2])
    assert [r["run_id"] for r in reports.list_reports(tmp_path, "logs", "raw")] == ids[:1:-1]
    assert not reports.report_path(tmp_path, "logs", "raw", f"{ids[0]}.html").exists()
    assert sum("pruned report logs/raw/" in m for m in caplog.messages) == 2


def test_localized_page_loads_nothing_remote():
    html = ('<head><link rel="stylesheet" href="https://maxcdn.bootstrapcdn.com/b.css"/>'
            '<script src="https://code.jquery.com/jquery-3.7.1.min.js"></script>'
            '<link rel="icon" href="../../../../static/images/favicon.ico"></head><body>'
            '<style>.x{background: url(\'https://s3.example/full_logo_dark.png\') 0 0}</style>'
            '<img src="https://great-expectations-web-assets.s3.us-east-2.amazonaws.com/logo-long.png?d=1">'
            '<a href="../../../../../index.html">Home</a><a href="https://greatexpectations.io/x">out</a></body>')
    out = docs.localize_page(html, "../../_static")
    assert not docs.REMOTE_RESOURCE.search(out), out
    assert 'href="../../_static/images/favicon.ico"' in out
    assert 'src="../../_static/images/logo-long.png"' in out
    assert 'href="../../_static/isbflow-docs.css"' in out
    assert "index.html" not in out and 'href="https://greatexpectations.io/x"' in out
    assert docs.REMOTE_RESOURCE.search(html)  # the detector does detect


# ------------------------------------------------------------------ built-in checks


def test_completeness_counts_holes_minus_dead_letters(spark):
    ids = [f"in/0/{i}" for i in range(1, 101) if i not in (10, 11, 12, 50, 77)] + \
          [f"in/1/{i}" for i in range(5, 21) if i != 6] + ["in/0/3", "bogus"]
    df = spark.createDataFrame([(i,) for i in ids], "_isb_id string")
    basis = checks.SinkOffsetBasis(frozenset({"in/0/50", "in/0/12", "in/1/6", "in/0/500"}))
    r = checks.completeness(df, basis)
    # in/0: 10, 11, 77 missing (12 and 50 dead-lettered); in/1: 6 dead-lettered; plus one malformed id
    assert (r.success, r.unexpected_count) == (False, 4)
    assert r.details["missing"] == {"in/0": 3}
    assert r.details["malformed_ids"] == 1 and r.details["dead_lettered"] == 3
    assert r.samples == ["in/0/10", "in/0/11", "in/0/77"]
    clean = checks.completeness(spark.createDataFrame([(f"in/0/{i}",) for i in range(3, 9)], "_isb_id string"),
                                checks.SinkOffsetBasis())
    assert clean.success and clean.details["ranges"] == {"in/0": [3, 8]}


def test_ledger_completeness_names_lost_offsets_and_lists_records_in_flight(spark):
    from isbflow.isb.ledger import CommittedWatermark

    ids = [f"in/0/{i}" for i in range(1, 31) if i not in (7, 8)] + ["in/0/5", "bogus"]
    df = spark.createDataFrame([(i,) for i in ids], "_isb_id string")
    present = checks.present_ranges(df)
    assert present == ({"in/0": [[1, 6], [9, 30]]}, 1)
    assert checks.duplicate_ids(df) == (1, 1, ["in/0/5"])
    mark = CommittedWatermark("raw", {"in/0": 25}, True)
    verdicts, malformed = checks.judge_sink(df, {"in/0": [[1, 30]]}, {"in/0": [[8, 8]]}, {"in/0": (1, 40)}, mark,
                                            present)
    now = datetime.now(UTC)
    r = checks.ledger_completeness(verdicts, malformed, now, lambda part, seq: now.timestamp() - 60 - seq, mark)
    # 7 is lost (8 is dead-lettered); 31..40 are in flight, never a failure; plus the malformed id
    assert (r.success, r.unexpected_count, r.samples) == (False, 2, ["in/0/7"])
    assert r.details["proven"] == {"in/0": [[1, 6], [8, 30]]} and r.details["ranges"] == {"in/0": [1, 30]}
    assert r.details["in_flight"] == {"count": 10, "oldest": "in/0/31", "oldest_age_s": pytest.approx(91, abs=1)}
    assert checks.in_flight_upto(verdicts, {"in/0": 33}) == 3


def test_freshness_uses_the_injected_clock(spark):
    df = spark.createDataFrame([(datetime(2025, 1, 1, 0, 0, 30, tzinfo=UTC),)], "ts timestamp")
    newest = datetime(2025, 1, 1, 0, 0, 30, tzinfo=UTC)
    assert checks.freshness(df, 60, newest + timedelta(seconds=59)).success
    stale = checks.freshness(df, 60, newest + timedelta(seconds=61))
    assert not stale.success and stale.details["lag_s"] == 61 and stale.samples == [newest.isoformat()]
    assert checks.freshness(df, None, newest).skipped


# ------------------------------------------------------------------ end to end on the demo


def _by_name(report) -> dict[str, checks.CheckResult]:
    out = {}
    for c in report.checks:
        key = c.name if c.origin == "builtin" else f"{c.name}:{c.kwargs.get('column')}"
        out[key] = c
    return out


def _checks_of(report: dict) -> dict[str, dict]:
    return {c["name"] if c["origin"] == "builtin" else f"{c['name']}:{c['kwargs'].get('column')}": c
            for c in report["checks"]}


def test_demo_sinks_on_the_ledger_with_records_in_flight_then_injected_bad_data(spark, nats_server):
    """One run of the demo serves every assertion: the README's by-hand sequence (events stamped from
    now, available-now, ``quality run``) passes with records in flight; then bad data fails exactly."""
    from isbflow.ops.produce import produce, shift_for
    from isbflow.quality.basis import read_ledger_basis
    from tests.helpers.recovery import setup

    settings, data_dir = nats_server.settings, nats_server.data_dir
    specs, p = setup(settings, LOGS)
    shift = shift_for(datetime.now(UTC), 0)  # `isbflow produce --event-time-from now`
    count, flying = 20_000, 2_000  # 200 s of event time: the 2-minute watermark closes the first windows
    asyncio.run(produce(settings, p, count=count, seed=7, malformed_every=500, shift_ms=shift))
    runner = PipelineRunner(spark, specs, p, settings, data_dir)
    try:
        runner.run_available_now()
        schemas = {s: expected_schema(runner, s) for s in ("raw", "agg")}
    finally:
        runner.close()
    # produced after the run: in the source buffer, in flight
    asyncio.run(produce(settings, p, count=flying, seed=7, start=count, malformed_every=500, shift_ms=shift))
    raw_path, agg_path = str(data_dir / "sinks/logs/raw"), str(data_dir / "sinks/logs/agg")
    letters = dead_letter_ids(settings, p.name)
    assert len(letters) == count // 500

    # ---- `isbflow quality run` on the real clock: both sinks pass, the records in flight are listed
    cli = CliRunner()
    args = ["quality", "run", "-f", str(LOGS), "--data-dir", str(data_dir), "--json"]
    result = cli.invoke(_cli(), args)
    assert result.exit_code == 0, result.output
    clean = {r["sink"]: r for r in json.loads(result.stdout)}
    paths = {"raw": raw_path, "agg": agg_path, "errors": str(data_dir / "sinks/logs/errors")}
    assert set(clean) == set(paths)
    for s, r in clean.items():
        assert r["success"], (s, r["failures"])
        # the errors sink is routed (a subset: no completeness by offsets) and asks no freshness
        may_skip = {"raw": set(), "agg": {"completeness"}, "errors": {"completeness", "freshness"}}[s]
        assert not [c["name"] for c in r["checks"] if c["skipped"] and c["name"] not in may_skip], (s, r["checks"])
        assert r["table_version"] == DeltaTable(paths[s]).version()
        if s != "errors":
            assert _checks_of(r)["freshness"]["success"]  # events stamped from now are fresh
    raw_checks = _checks_of(clean["raw"])
    complete = raw_checks["completeness"]["details"]
    part = complete["partitions"]["in/0"]
    assert complete["basis"] == "ledger" and part["watermark"] == count
    assert part["watermark_from"] == "committed by every step from the source to the sink"
    assert part["proven"] == [[1, count]] and complete["ranges"] == {"in/0": [1, count]}
    assert part["dead_lettered"] == len(letters) and part["missing"] == 0
    assert part["in_flight"]["count"] == flying and part["in_flight"]["oldest"] == count + 1
    assert complete["in_flight"]["oldest"] == f"in/0/{count + 1}"
    assert 0 <= complete["in_flight"]["oldest_age_s"] < 900
    assert complete["watermark"]["confirmed"] and complete["watermark"]["steps"][-1] == "raw"
    assert raw_checks["uniqueness"]["engine"] == "gx"
    assert clean["raw"]["offsets"] == {"in/0": [1, count]} and clean["raw"]["rows"] == count - len(letters)
    windows = _checks_of(clean["agg"])["windows"]["details"]
    assert windows["checked"] == windows["closed"] > 0 and windows["open"] > 0
    assert windows["pending"] == windows["open"] and windows["waiting_for_raw"] == 0
    assert "'minutely', committed into 'agg'" in windows["watermark_from"]
    watermark = datetime.fromisoformat(windows["watermark"])
    agg = DeltaTable(agg_path).to_pyarrow_table()
    ends = agg.column("window_end").to_pylist()
    assert windows["open"] == sum(e > watermark for e in ends) and windows["closed"] == sum(e <= watermark for e in ends)
    assert all(datetime.fromisoformat(w["window_end"]) > watermark for w in windows["pending_samples"])
    page = reports.report_path(data_dir, "logs", "raw", clean["raw"]["docs"]).read_text()
    assert "expect_column_values_to_be_between" in page or "values must be greater than" in page
    assert not docs.REMOTE_RESOURCE.search(page)
    for ref in re.findall(r'(?:href|src)="(\.\./\.\./_static/[^"]+)"', page):
        assert (reports.report_path(data_dir, "logs", "raw") / ref).resolve().exists(), ref

    # ---- the offline proof from the table alone: every commit is isbflow's, every claimed offset held once
    proof = verify_table(raw_path)
    assert proof.ok, proof.problems()
    assert proof.proven == proof.claimed == {"in/0": ledger.difference(
        [[1, count]], ledger.dead_letter_ranges(letters)["in/0"])}

    # ---- inject bad data with deltalake
    raw = DeltaTable(raw_path)
    table = raw.to_pyarrow_table()
    ids = table.column("_isb_id").to_pylist()
    dup_ids, null_ids, neg_ids = ids[100:117], ids[200:204], ids[300:302]
    # a row of a closed window of another service than the one edited below: its window recounts one short
    touched = {*dup_ids, *null_ids, *neg_ids}
    lost_row = next(r for r in table.to_pylist() if r["service"] != "checkout" and r["_isb_id"] not in touched
                    and r["ts"].replace(second=0, microsecond=0) + timedelta(minutes=1) <= watermark)
    lost = lost_row["_isb_id"]
    lost_ws = lost_row["ts"].replace(second=0, microsecond=0)
    write_deltalake(raw_path, table.filter(pa.compute.is_in(table.column("_isb_id"), pa.array(dup_ids))),
                    mode="append")  # 17 rows twice
    DeltaTable(raw_path).delete(f"_isb_id = '{lost}'")
    DeltaTable(raw_path).update(updates={"host": "NULL"},
                                predicate="_isb_id IN (" + ", ".join(f"'{i}'" for i in null_ids) + ")")
    DeltaTable(raw_path).update(updates={"latency_ms": "-5.0"},
                                predicate="_isb_id IN (" + ", ".join(f"'{i}'" for i in neg_ids) + ")")
    rows = agg.to_pylist()
    closed = min((r for r in rows if r["window_end"] <= watermark and r["service"] == "checkout"),
                 key=lambda r: r["window_start"])
    closed["count"] += 5  # a closed window with a wrong count
    first = min(r["window_start"] for r in rows)
    late = {**rows[0], "window_start": first - timedelta(minutes=10), "window_end": first - timedelta(minutes=9),
            "service": "checkout", "count": 3}  # a window no raw record makes
    write_deltalake(agg_path, pa.Table.from_pylist([*rows, late], schema=agg.schema), mode="overwrite")

    basis = read_ledger_basis(settings, p, data_dir, wait_s=5)
    later = datetime.now(UTC)
    bad = {s: run_quality(spark, p, s, data_dir, basis=basis, schema=schemas[s], now=later) for s in ("raw", "agg")}
    raw_failed = {k: c for k, c in _by_name(bad["raw"]).items() if not c.success}
    assert {k: c.unexpected_count for k, c in raw_failed.items()} == {
        "completeness": 1,  # the deleted row: the ledger says the sink committed it
        "uniqueness": 17,  # surplus rows (GX counts every row of a repeated id: 34)
        "expect_column_values_to_not_be_null:host": 4,
        "expect_column_values_to_be_between:latency_ms": 2,
    }
    assert raw_failed["completeness"].samples == [lost]
    assert raw_failed["completeness"].details["in_flight"]["count"] == flying  # still not a failure
    assert raw_failed["uniqueness"].details["unexpected_rows"] == 34
    assert set(raw_failed["uniqueness"].samples) <= set(dup_ids)
    assert raw_failed["expect_column_values_to_be_between:latency_ms"].samples == [-5.0, -5.0]
    assert bad["raw"].gate_failed and bad["raw"].table_version == DeltaTable(raw_path).version()
    agg_failed = [c for c in bad["agg"].checks if not c.success]
    assert [(c.name, c.unexpected_count) for c in agg_failed] == [("windows", 3)]
    found = {(m["window_start"], m["service"]): (m["count"], m["recomputed"]) for m in agg_failed[0].samples}
    n = closed["count"]
    held = next(r["count"] for r in rows if r["window_start"] == lost_ws and r["service"] == lost_row["service"])
    assert lost_ws + timedelta(minutes=1) <= watermark
    assert found == {(late["window_start"].isoformat(), "checkout"): (3, 0),
                     (closed["window_start"].isoformat(), "checkout"): (n, n - 5),
                     (lost_ws.isoformat(), lost_row["service"]): (held, held - 1)}
    assert agg_failed[0].details["pending"] == windows["pending"]  # the open windows: pending, not failed
    assert not bad["agg"].gate_failed  # agg's gate is warn

    proof = verify_table(raw_path)
    assert not proof.ok and proof.missing == {"in/0": [[int(lost.rpartition("/")[2])] * 2]}
    assert proof.surplus_rows == 17 and ledger.count(proof.duplicated["in/0"]) == 17
    assert [c.operation for c in proof.foreign] == ["WRITE", "DELETE", "UPDATE", "UPDATE"]

    # ---- without the ISB service: the sink basis, said clearly; the fail gate exits 1
    result = cli.invoke(_cli(), [*args, "--sink", "raw", "--nats-url", "nats://127.0.0.1:9"])
    assert result.exit_code == 1, result.output
    assert "FALLS BACK to the sink basis" in result.stderr
    fallback = _checks_of(json.loads(result.stdout)[0])["completeness"]
    assert fallback["details"]["basis"] == "SinkOffsetBasis" and "unreachable" in fallback["details"]["basis_note"]
    assert set(fallback["samples"]) <= letters | {lost}  # dead letters are unknown to it: holes

    result = cli.invoke(_cli(), ["quality", "reports", "-f", str(LOGS), "--data-dir", str(data_dir), "--json"])
    assert result.exit_code == 0
    listed = json.loads(result.stdout)
    assert [r["run_id"] for r in listed if r["sink"] == "raw"][1:] == [bad["raw"].run_id, clean["raw"]["run_id"]]
    assert {f["name"] for f in listed[0]["failures"]} == {"completeness", "uniqueness",
                                                          "expect_column_values_to_not_be_null",
                                                          "expect_column_values_to_be_between"}
    assert len([r for r in listed if r["sink"] == "agg"]) == 2
