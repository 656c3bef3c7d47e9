"""Shadow reprocess, review and promote (isbflow.recovery.shadow, .reprocess_promote, isbflow.ops.replay)
on a real nats-server, the session Spark and real Delta tables.

The pipeline is tests/specs/reprocess-logs.yaml with a suite on the raw sink
(``version`` between 1 and 2). A changed transform (``VERSION`` 2) is
shadowed: the live tables keep their versions, the diff names exactly the
changed rows and columns, the suite passes on the shadow table, and the promote
is one Delta commit per raw sink touching only the range. ``VERSION`` 3 fails
the suite on its shadow, and its promote is refused naming the check. A shadow
whose range the live sink changed afterwards is refused as stale (through the
command, with ``--json``).
"""

from __future__ import annotations

import json

import pytest
from deltalake import DeltaTable

from isbflow.isb import ledger
from isbflow.ops import replay as ops_replay
from isbflow.quality.reports import list_reports
from isbflow.recovery.reprocess import reprocess
from isbflow.recovery.shadow import ShadowError, load_run, run_dir
from tests.helpers import reprocess_transforms
from tests.recovery.test_reprocess import (
    SPEC,
    check_agg_equals_recount,
    good_seqs,
    raw_rows,
    seq_of,
    setup_and_run,
)

SUITE = """\
  transformPackages: [tests.helpers]
  quality:
    - sink: raw
      onFailure: fail
      expectations:
        - expectation: expect_column_values_to_be_between
          kwargs: {column: version, min_value: 1, max_value: 2}
"""
CHECK = "expect_column_values_to_be_between"


def _pipeline(spark, settings, data_dir):
    spec = data_dir / "reprocess-shadow.yaml"
    spec.write_text(SPEC.read_text() + SUITE)
    specs, p = setup_and_run(spark, settings, data_dir, spec)
    return spec, specs, p


def versions(data_dir) -> tuple[int, int]:
    return DeltaTable(str(data_dir / "sinks/rp/raw")).version(), DeltaTable(str(data_dir / "sinks/rp/agg")).version()


def test_shadow_diff_suites_then_promote_one_commit(spark, nats_server):
    settings, data_dir = nats_server.settings, nats_server.data_dir
    spec, specs, p = _pipeline(spark, settings, data_dir)
    raw_path = str(data_dir / "sinks/rp/raw")
    before = raw_rows(data_dir)
    v_raw, v_agg = versions(data_dir)
    lo, hi = 2001, 3000
    in_range = {i for i in before if lo <= seq_of(i) <= hi}
    assert len(in_range) == len(good_seqs(lo, hi))
    go = dict(specs=specs, p=p, settings=settings, data_dir=data_dir)

    # ---- shadow of a changed transform: the diff, the suite on the shadow table, live untouched
    reprocess_transforms.VERSION = 2
    phases = []
    review = ops_replay.replay(lambda: spark, **go, mode="reprocess", from_offset=lo, to_offset=hi, shadow=True,
                               on_phase=phases.append)
    print(review.summary())
    assert review.ok and review.promotable and review.refusals == [], review.summary()
    assert [ph.name for ph in phases] == ["plan", "read", "shadow"]
    assert versions(data_dir) == (v_raw, v_agg)  # the live tables did not move
    assert raw_rows(data_dir) == before
    run = review.run
    rec = load_run(data_dir, p.name, run)
    assert (rec.state, rec.range) == ("shadowed", {"in/0": [[lo, hi]]})
    raw = rec.sink("raw")
    assert raw.live_version == v_raw and raw.shadow_path == str(run_dir(data_dir, p.name, run) / "raw")
    n = len(in_range)
    scored = {i for i in in_range if before[i]["latency_ms"] != 0}  # score = latency_ms * VERSION
    d = raw.diff
    assert (d["rows_before"], d["rows_after"], d["added"], d["removed"], d["changed"], d["unchanged"]) == \
        (n, n, 0, 0, n, 0)
    assert d["columns"]["version"] == n and d["columns"]["score"] == len(scored)
    assert {c for c, k in d["columns"].items() if k} == {"version", "score"}
    sample = d["samples"]["changed"]
    assert len(sample) == 5 and all(s["changes"]["version"] == [1, 2] for s in sample)
    assert all(s["key"]["_isb_id"] in in_range for s in sample)
    # the shadow table is the live table with the range replaced
    shadow = {r["_isb_id"]: r for r in DeltaTable(raw.shadow_path).to_pyarrow_table().to_pylist()}
    assert set(shadow) == set(before)
    assert {i for i, r in shadow.items() if r["version"] == 2} == in_range
    assert all(shadow[i] == before[i] for i in set(before) - in_range)
    # the suite ran on the shadow table: a normal quality report, tagged with the run and its diff
    assert raw.quality["success"] is True and raw.quality["failures"] == []
    stored = next(r for r in list_reports(data_dir, p.name, "raw") if r["run_id"] == raw.quality["run_id"])
    assert stored["table_path"] == raw.shadow_path and stored["success"] is True
    assert (stored["shadow"]["run"], stored["shadow"]["live_version"]) == (run, v_raw)
    assert stored["shadow"]["diff"]["changed"] == n
    agg = rec.sink("agg")
    assert agg.kind == "aggregate" and agg.shadow_path is None and agg.rows_before >= 2  # windows touched
    out = review.to_json()
    assert out["state"] == "shadowed" and out["shadow_run"] == run and out["suites"]["raw"]["success"] is True
    assert json.loads(json.dumps(out, default=str))["diffs"]["raw"]["changed"] == n

    # ---- a transform that breaks the suite: the shadow says which check, and its promote is refused
    reprocess_transforms.VERSION = 3
    bad = ops_replay.replay(lambda: spark, **go, mode="reprocess", from_offset=3001, to_offset=3500, shadow=True)
    print(bad.summary())
    assert not bad.ok and not bad.promotable
    assert len(bad.refusals) == 1 and CHECK in bad.refusals[0] and "sink raw" in bad.refusals[0]
    assert load_run(data_dir, p.name, bad.run).sink("raw").quality["failures"][0]["name"] == CHECK
    assert f"FAILED: {CHECK}" in bad.summary()
    with pytest.raises(ops_replay.ReplayError, match=f"refused: .*sink raw: the suite failed on the shadow table.*"
                                                      f"{CHECK}") as e:
        ops_replay.promote(lambda: spark, **go, run=bad.run)
    assert not e.value.usage
    assert versions(data_dir) == (v_raw, v_agg)
    with pytest.raises(ops_replay.ReplayError, match="is not a shadow run id") as e:
        ops_replay.promote(lambda: spark, **go, run="../../etc")
    assert e.value.usage
    with pytest.raises(ShadowError, match="no shadow run reprocess-20200101T000000Z of pipeline rp"):
        load_run(data_dir, p.name, "reprocess-20200101T000000Z")

    # ---- promote the good one: one commit per raw sink, only the range, windows recomputed
    reprocess_transforms.VERSION = 99  # the promote writes the reviewed rows, not what the code makes now
    phases = []
    report = ops_replay.promote(lambda: spark, **go, run=run, on_phase=phases.append)
    print(report.summary())
    assert report.ok and report.state == "promoted", json.dumps(report.to_json(), default=str)
    assert [ph.name for ph in phases] == ["check", "replace", "windows", "verify"]
    assert versions(data_dir) == (v_raw + 1, v_agg + 1)  # one Delta commit per sink
    res = {s.sink: s for s in report.sinks}
    assert (res["raw"].commits, res["raw"].updated, res["raw"].inserted, res["raw"].deleted) == (1, n, 0, 0)
    after = raw_rows(data_dir)
    assert set(after) == set(before)
    assert {i for i, r in after.items() if r["version"] == 2} == in_range
    assert all(after[i] == before[i] for i in set(before) - in_range)  # ids outside the range untouched
    assert after == shadow
    history = DeltaTable(raw_path).history(1)[0]
    assert history["operation"] == "MERGE" and history["isb.operation"] == "replace_keys"
    assert json.loads(history["isb.reprocess"])["shadow_run"] == run
    assert ledger.from_metadata(history[ledger.OFFSETS_KEY]) == {"in/0": [[lo, hi]]}
    check_agg_equals_recount(data_dir, after)
    assert load_run(data_dir, p.name, run).state == "promoted"
    with pytest.raises(ops_replay.ReplayError, match="was promoted already"):
        ops_replay.promote(lambda: spark, **go, run=run)
    assert versions(data_dir) == (v_raw + 1, v_agg + 1)


def test_a_stale_shadow_is_refused_through_the_command(spark, nats_server):
    """A shadow whose range the live sink changed afterwards (a plain reprocess) is refused; one whose
    live sink moved only outside its range is promoted. Through ``isbflow replay --shadow/--promote``."""
    from typer.testing import CliRunner

    from isbflow.cli import app

    settings, data_dir = nats_server.settings, nats_server.data_dir
    spec, specs, p = _pipeline(spark, settings, data_dir)
    base = ["replay", "-f", str(spec), "--data-dir", str(data_dir)]
    cli = CliRunner()

    r = cli.invoke(app, [*base, "--promote", "reprocess-1"])
    assert r.exit_code == 2 and "is not a shadow run id" in r.output
    r = cli.invoke(app, [*base, "--promote", "reprocess-20200101T000000Z", "--shadow"])
    assert r.exit_code == 2 and "drop --shadow" in r.output
    r = cli.invoke(app, [*base, "--mode", "reprocess", "--from", "1", "--to", "5", "--shadow", "--dry-run"])
    assert r.exit_code == 2 and "not both" in r.output

    reprocess_transforms.VERSION = 2
    shadows = {}
    for lo, hi in ((1001, 1100), (4001, 4100)):
        r = cli.invoke(app, [*base, "--mode", "reprocess", "--from", str(lo), "--to", str(hi), "--shadow", "--json"])
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert (out["state"], out["promotable"], out["diffs"]["raw"]["changed"]) == \
            ("shadowed", True, len(good_seqs(lo, hi)))
        shadows[lo] = out["shadow_run"]
    v_raw, _ = versions(data_dir)
    # the live sink's rows of 1050..1060 change after the first shadow was made (a reprocess with other
    # code; one that rewrote the same values would leave the range as the shadow saw it)
    reprocess_transforms.VERSION = 5
    reprocess(spark, specs, p, settings, data_dir, from_offset=1050, to_offset=1060)
    assert versions(data_dir)[0] == v_raw + 1
    r = cli.invoke(app, [*base, "--promote", shadows[1001], "--json"])
    assert r.exit_code == 1
    assert "the live table's rows of the range changed since the shadow was made" in r.output
    assert f"version {v_raw} -> {v_raw + 1}" in r.output
    assert versions(data_dir)[0] == v_raw + 1
    # the second shadow's range (4001..4100) was not touched: the live sink moved outside it only
    r = cli.invoke(app, [*base, "--promote", shadows[4001], "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["state"], out["ok"], out["shadow_run"]) == ("promoted", True, shadows[4001])
    check = next(ph for ph in out["phases"] if ph["name"] == "check")
    assert check["detail"]["moved_outside_the_range"] == {"raw": [v_raw, v_raw + 1]}
    assert versions(data_dir)[0] == v_raw + 2
    now = raw_rows(data_dir)
    assert {i for i, r in now.items() if r["version"] == 2} == {f"in/0/{s}" for s in good_seqs(4001, 4100)}
