"""Reprocess (isbflow.recovery.reprocess) on a real nats-server, the session Spark and real Delta tables.

The pipeline (tests/specs/reprocess-logs.yaml) stamps rows with the module
global ``tests.helpers.reprocess_transforms.VERSION``; a test runs it with version 1,
changes the version and reprocesses a sub-range: exactly the range's rows
change, in one Delta commit per sink, and the aggregate windows equal a
recount from the raw sink.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from datetime import timedelta

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from isbflow.isb import ledger, provision
from isbflow.isb.connect import connect
from isbflow.ops.produce import BASE_TIME, is_malformed, produce
from isbflow.recovery.reprocess import (
    RangeError,
    ReprocessError,
    in_ranges,
    parse_offsets,
    reprocess,
)
from isbflow.sinks.delta import replace_keys
from isbflow.spec import load_specs
from isbflow.steps.runner import PipelineRunner
from tests.conftest import ROOT
from tests.helpers import reprocess_transforms

SPEC = ROOT / "tests" / "specs" / "reprocess-logs.yaml"
COUNT = 6000  # 60 s of event time: six 10-second windows per service
MALFORMED_EVERY = 500


# ----------------------------------------------------------------------------- helpers


def setup_and_run(spark, settings, data_dir, spec=SPEC):
    """Provision ``spec``'s pipeline, produce COUNT events, run it once with transform version 1."""
    specs = load_specs(spec)
    p = specs.only_pipeline()
    asyncio.run(provision.apply(settings, specs))
    r = asyncio.run(produce(settings, p, count=COUNT, seed=3, malformed_every=MALFORMED_EVERY))
    assert r.published == COUNT
    reprocess_transforms.VERSION = 1
    runner = PipelineRunner(spark, specs, p, settings, data_dir)
    try:
        runner.run_available_now()
    finally:
        runner.close()
    return specs, p


def with_helpers_package(text: str) -> str:
    """A copy of a tests/specs pipeline outside tests/ names the package of its transforms
    (``transformPackages``, isbflow.spec.transforms): the Pipeline's spec gains it."""
    head, sep, tail = text.rpartition("\nspec:\n")
    return f"{head}{sep}  transformPackages: [tests.helpers]\n{tail}"


def good_seqs(lo=1, hi=COUNT):
    return {s for s in range(lo, hi + 1) if not is_malformed(s - 1, MALFORMED_EVERY)}


def raw_rows(data_dir, version=None) -> dict[str, dict]:
    t = DeltaTable(str(data_dir / "sinks/rp/raw"), version=version).to_pyarrow_table()
    ids = t.column("_isb_id").to_pylist()
    assert len(ids) == len(set(ids)), "duplicate _isb_id in the raw sink"
    return dict(zip(ids, t.to_pylist(), strict=True))


def agg_rows(data_dir) -> dict[tuple, dict]:
    rows = DeltaTable(str(data_dir / "sinks/rp/agg")).to_pyarrow_table().to_pylist()
    out = {(r["window_start"], r["service"]): r for r in rows}
    assert len(out) == len(rows), "a window twice in agg"
    return out


def recount(raw: dict[str, dict]) -> dict[tuple, tuple[int, float]]:
    acc: dict[tuple, list] = defaultdict(lambda: [0, 0.0])
    for r in raw.values():
        ts = r["ts"]
        start = ts.replace(second=ts.second - ts.second % 10, microsecond=0)
        acc[(start, r["service"])][0] += 1
        acc[(start, r["service"])][1] += r["score"]
    return {k: (n, s) for k, (n, s) in acc.items()}


def check_agg_equals_recount(data_dir, raw):
    agg = agg_rows(data_dir)
    want = recount(raw)
    assert set(agg) == set(want)
    for k, row in agg.items():
        assert row["count"] == want[k][0], k
        assert row["score"] == pytest.approx(want[k][1]), k


async def _ledger(settings, pipeline):
    nc = await connect(settings)
    try:
        return await ledger.read(nc, pipeline)
    finally:
        await nc.close()


def seq_of(isb_id: str) -> int:
    return int(isb_id.rsplit("/", 1)[1])


# ----------------------------------------------------------------------------- pure parts


def test_offsets_forms_and_errors():
    one, two = ["in/0"], ["in/0", "other/0"]
    assert parse_offsets(7, one, "from") == {"in/0": 7}
    assert parse_offsets("7", one, "from") == {"in/0": 7}
    assert parse_offsets("in:7", two, "from") == {"in/0": 7}
    assert parse_offsets("in/0:7, other/0:9", two, "to") == {"in/0": 7, "other/0": 9}
    assert parse_offsets({"other": 3}, two, "to") == {"other/0": 3}
    assert parse_offsets(None, one, "from") == {}
    with pytest.raises(RangeError, match="a bare sequence needs a pipeline with one source partition"):
        parse_offsets(7, two, "from")
    with pytest.raises(RangeError, match="'nope' is not a source partition of this pipeline"):
        parse_offsets("nope:7", two, "from")
    with pytest.raises(RangeError, match="source offsets start at 1, got 0"):
        parse_offsets(0, one, "to")
    with pytest.raises(RangeError, match="'x' is not a source offset"):
        parse_offsets("in:x", one, "to")
    with pytest.raises(RangeError, match="partition in/0 is named twice"):
        parse_offsets("in:1,in/0:2", one, "to")


def test_in_ranges_mask():
    ids = pa.array(["in/0/1", "in/0/5", "in/0/9", "in/1/5", None, "junk", "in/0/x", "other/0/5"])
    mask = in_ranges(ids, {"in/0": [[1, 2], [5, 7]], "other/0": [[5, 5]]})
    assert mask.tolist() == [True, True, False, False, False, False, False, True]


def test_replace_keys_one_commit(tmp_path):
    from deltalake import write_deltalake

    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"_isb_id": [f"in/0/{i}" for i in range(1, 11)], "v": list(range(10))}))
    r = replace_keys(path, pa.table({"v": [100, 101, 102], "_isb_id": ["in/0/3", "in/0/4", "in/0/20"]}),
                     pa.table({"_isb_id": ["in/0/3", "in/0/4", "in/0/5", "in/0/6"]}))
    assert (r.version, r.deleted, r.updated, r.inserted) == (1, 2, 2, 1)
    got = {x["_isb_id"]: x["v"] for x in DeltaTable(path).to_pyarrow_table().to_pylist()}
    assert got == {"in/0/1": 0, "in/0/2": 1, "in/0/3": 100, "in/0/4": 101, "in/0/7": 6, "in/0/8": 7,
                   "in/0/9": 8, "in/0/10": 9, "in/0/20": 102}
    # composite keys with a null compare null-safe
    q = str(tmp_path / "q")
    write_deltalake(q, pa.table({"w": [1, 1, 2], "s": ["a", None, None], "c": [1, 2, 3]}))
    r = replace_keys(q, pa.table({"w": [1], "s": pa.array([None], pa.string()), "c": [20]}),
                     pa.table({"w": [1, 1], "s": ["a", None]}), key=["w", "s"])
    assert (r.deleted, r.updated, r.inserted) == (1, 1, 0)
    assert sorted(DeltaTable(q).to_pyarrow_table().to_pylist(), key=lambda x: x["c"]) == [
        {"w": 2, "s": None, "c": 3}, {"w": 1, "s": None, "c": 20}]
    assert replace_keys(q, pa.table({"w": [], "s": [], "c": []}).cast(
        pa.schema([("w", pa.int64()), ("s", pa.string()), ("c", pa.int64())])),
        pa.table({"w": pa.array([], pa.int64()), "s": pa.array([], pa.string())}), key=["w", "s"]).version is None


# ----------------------------------------------------------------------------- scenarios


def test_reprocess_by_offsets(spark, nats_server, tmp_path):
    settings = nats_server.settings
    specs, p = setup_and_run(spark, settings, tmp_path)
    raw_path, agg_path = str(tmp_path / "sinks/rp/raw"), str(tmp_path / "sinks/rp/agg")
    before = raw_rows(tmp_path)
    assert {seq_of(i) for i in before} == good_seqs()
    assert {r["version"] for r in before.values()} == {1}
    agg_before = agg_rows(tmp_path)
    check_agg_equals_recount(tmp_path, before)
    v_raw, v_agg = DeltaTable(raw_path).version(), DeltaTable(agg_path).version()
    lo, hi = 2001, 3000
    go = dict(specs=specs, pipeline=p, settings=settings, data_dir=tmp_path)

    # bad ranges: clear errors, nothing changes
    for kw, message in [
        (dict(from_offset=3000, to_offset=2000), "in/0: the range 3000..2000 is empty"),
        (dict(from_offset=1, to_offset=COUNT + 5), f"'to' {COUNT + 5} is past what the pipeline has processed"),
        (dict(from_offset="nope:1", to_offset=5), "'nope' is not a source partition of this pipeline"),
        (dict(from_offset=1, from_time="2025-01-01"), "not both"),
        (dict(), "give the range to reprocess"),
        (dict(from_time="2025-01-02", to_time="2025-01-01"), "is empty: 'from' must lie before 'to'"),
        (dict(from_time="2030-01-01"), "no record of the sources has event time in"),
    ]:
        with pytest.raises(RangeError, match=message):
            reprocess(spark, **go, **kw)

    # dry run: counts, no change
    reprocess_transforms.VERSION = 2
    dry = reprocess(spark, **go, from_offset=lo, to_offset=hi, dry_run=True)
    assert dry.ok and dry.state == "planned", dry.summary()
    assert dry.range == {"in/0": [[lo, hi]]}
    assert (dry.records_reread, dry.dead_lettered) == (hi - lo + 1, 2)
    sinks = {s.sink: s for s in dry.sinks}
    assert sinks["raw"].rows_before == len(good_seqs(lo, hi))
    assert sinks["agg"].windows_touched > 0
    assert (DeltaTable(raw_path).version(), DeltaTable(agg_path).version()) == (v_raw, v_agg)

    # the reprocess
    phases = []
    report = reprocess(spark, **go, from_offset=str(lo), to_offset=f"in:{hi}", on_phase=phases.append)
    print(report.summary())
    assert report.ok, json.dumps(report.to_json(), default=str)
    assert [ph.name for ph in report.phases] == ["plan", "read", "replace", "windows", "verify"]
    assert [ph.name for ph in phases] == ["plan", "read", "replace", "windows", "verify"]
    raw = {s.sink: s for s in report.sinks}["raw"]
    n = len(good_seqs(lo, hi))
    assert (raw.rows_before, raw.rows_after, raw.updated, raw.inserted, raw.deleted) == (n, n, n, 0, 0)
    assert (raw.commits, raw.version_before, raw.version) == (1, v_raw, v_raw + 1)

    after = raw_rows(tmp_path)
    assert set(after) == set(before)  # counts equal, no duplicates, the same ids
    for i, row in after.items():
        if lo <= seq_of(i) <= hi:
            assert row["version"] == 2 and row["score"] == pytest.approx(2 * row["latency_ms"]), i
            assert {k: v for k, v in row.items() if k not in ("version", "score")} == \
                {k: v for k, v in before[i].items() if k not in ("version", "score")}
        else:
            assert row == before[i], i
    # one commit: each version of the table is all old or all new for the range
    assert DeltaTable(raw_path).version() == v_raw + 1
    assert raw_rows(tmp_path, v_raw) == before
    history = DeltaTable(raw_path).history(1)[0]
    assert history["operation"] == "MERGE" and history["isb.operation"] == "replace_keys"
    assert ledger.from_metadata(history[ledger.OFFSETS_KEY]) == {"in/0": [[lo, hi]]}
    assert json.loads(history["isb.reprocess"])["range"] == {"in/0": [[lo, hi]]}
    # the ledger holds the range, in the table's history and in the KV
    assert ledger.count(ledger.from_delta_history(raw_path)["in/0"]) == len(good_seqs()) + 2  # + dead-lettered
    kv = asyncio.run(_ledger(settings, p.name))["raw"]["in/0"]
    assert ledger.first_gap(kv, lo) > hi  # the whole range, dead-lettered sequences included

    # the aggregate: touched windows recomputed in one commit, the others as they were
    agg = {s.sink: s for s in report.sinks}["agg"]
    assert agg.commits == 1 and DeltaTable(agg_path).version() == v_agg + 1
    assert agg.windows_touched >= 2 and agg.duplicates == 0
    check_agg_equals_recount(tmp_path, after)
    now = agg_rows(tmp_path)
    changed = {k for k in now if now[k] != agg_before.get(k)}
    touched_starts = {k[0] for k in changed}
    first_ts = min(r["ts"] for i, r in after.items() if lo <= seq_of(i) <= hi)
    last_ts = max(r["ts"] for i, r in after.items() if lo <= seq_of(i) <= hi)
    assert changed and all(first_ts - timedelta(seconds=10) < s <= last_ts for s in touched_starts)
    assert len(now) == len(agg_before)

    # records of the range still in flight (in a buffer, not yet in the sinks) are refused
    r = asyncio.run(produce(settings, p, count=300, seed=3, start=COUNT, malformed_every=MALFORMED_EVERY))
    assert r.published == 300
    runner = PipelineRunner(spark, specs, p, settings, tmp_path)
    try:
        runner.run_available_now(only=["in"])
    finally:
        runner.close()
    with pytest.raises(ReprocessError, match="still in flight in buffer isb-rp-in-tag-") as e:
        reprocess(spark, **go, from_offset=COUNT - 99, to_offset=COUNT + 100)
    assert not isinstance(e.value, RangeError)
    assert DeltaTable(raw_path).version() == v_raw + 1


APPEND_ONLY = "        output: update\n        keys: [window_start, service]\n"


def secs(ts) -> float:
    """Seconds of event time after the producer's BASE_TIME."""
    return (ts - BASE_TIME).total_seconds()


def test_reprocess_by_event_time_append_windows_and_cli(spark, nats_server):
    """Event-time range on a pipeline whose aggregate is append-mode: windows the sink holds are
    recomputed, windows still open in the streaming step are left to it; then the command."""
    from typer.testing import CliRunner

    from isbflow.cli import app

    settings = nats_server.settings
    tmp_path = nats_server.data_dir  # the command finds the server and the sinks under one data dir
    text = SPEC.read_text()
    assert APPEND_ONLY in text
    spec = tmp_path / "reprocess-append.yaml"
    spec.write_text(with_helpers_package(text.replace(APPEND_ONLY, "")))
    specs, p = setup_and_run(spark, settings, tmp_path, spec)
    raw_path, agg_path = str(tmp_path / "sinks/rp/raw"), str(tmp_path / "sinks/rp/agg")
    before = raw_rows(tmp_path)
    agg_before = agg_rows(tmp_path)
    # a 30 s watermark over 60 s of events (jitter: from -5 s) has closed the windows up to 20 s only
    assert {secs(k[0]) for k in agg_before} == {-10, 0, 10}
    v_raw, v_agg = DeltaTable(raw_path).version(), DeltaTable(agg_path).version()
    t_lo, t_hi = BASE_TIME + timedelta(seconds=10), BASE_TIME + timedelta(seconds=15)

    reprocess_transforms.VERSION = 3
    report = reprocess(spark, specs, p, settings, tmp_path, from_time=t_lo, to_time=t_hi.isoformat())
    print(report.summary(), [(ph.name, ph.seconds) for ph in report.phases])
    assert report.ok, json.dumps(report.to_json(), default=str)
    assert report.mode == "event-time" and report.time_column == {"in": "ts"}
    selected = {i for i, r in before.items() if t_lo <= r["ts"] < t_hi}
    assert report.records_reread == len(selected)
    assert ledger.count(report.range["in/0"]) == len(selected)
    after = raw_rows(tmp_path)
    assert set(after) == set(before)
    assert {i for i, r in after.items() if r["version"] == 3} == selected
    assert all(after[i] == before[i] for i in set(before) - selected)
    assert DeltaTable(raw_path).version() == v_raw + 1
    agg = {s.sink: s for s in report.sinks}["agg"]
    assert (agg.windows_touched, agg.commits, agg.note) == (1, 1, None)
    assert DeltaTable(agg_path).version() == v_agg + 1
    now, want = agg_rows(tmp_path), recount(after)
    assert set(now) == set(agg_before)
    for k, row in now.items():
        assert (row["count"], row["score"]) == (want[k][0], pytest.approx(want[k][1])), k
        assert (row == agg_before[k]) == (secs(k[0]) != 10), k  # only [10, 20) changed

    # the command: a dry run, bad input, then a reprocess by offsets with --json
    base = ["replay", "-f", str(spec), "--data-dir", str(tmp_path), "--mode", "reprocess"]
    cli = CliRunner()
    r = cli.invoke(app, [*base, "--from", "100", "--to", "199", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "dry run of reprocess of pipeline rp" in r.output and "100 records to re-read" in r.output
    r = cli.invoke(app, [*base, "--from", "200", "--to", "100"])
    assert r.exit_code == 2 and "the range 200..100 is empty" in r.output
    r = cli.invoke(app, base)
    assert r.exit_code == 2 and "give the range to reprocess" in r.output
    r = cli.invoke(app, [*base[:-2], "--mode", "recover", "--from", "1"])
    assert r.exit_code == 2 and "--from: only with --mode reprocess" in r.output
    # 2501..2600 have event times from 20 s on: their window [20, 30) is still open in the step
    reprocess_transforms.VERSION = 4
    r = cli.invoke(app, [*base, "--from", "in:2501", "--to", "in/0:2600", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["ok"], out["state"], out["range"]) == (True, "reprocessed", {"in/0": [[2501, 2600]]})
    agg = next(s for s in out["sinks"] if s["sink"] == "agg")
    assert (agg["windows_touched"], agg["commits"]) == (0, 0)
    assert "touched window(s) not yet emitted by windows (still open in its state)" in agg["note"]
    final = raw_rows(tmp_path)
    assert {i for i, r in final.items() if r["version"] == 4} == {f"in/0/{s}" for s in good_seqs(2501, 2600)}
    assert agg_rows(tmp_path) == now
