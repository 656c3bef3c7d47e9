"""Recovery after buffer loss (isbflow.recovery) on a real nats-server and a real SparkSession.

Each scenario loses buffers for real (a stream deleted; memory buffers wiped by
a server restart), recovers, and ends with sink checks: the raw sink holds
every well-formed produced event exactly once, and every aggregate window
equals a recomputation from the raw sink.
"""

from __future__ import annotations

import asyncio
import json
import math

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from nats.js.api import StorageType, StreamConfig

from isbflow.isb import ledger, naming, provision, reference
from isbflow.isb.connect import connect
from isbflow.isb.loss import detect_loss
from isbflow.isb.server import start_embedded, stop_embedded
from isbflow.ops.produce import is_malformed, produce
from isbflow.recovery.recover import recover
from isbflow.spec import load_specs
from tests.conftest import ROOT
from tests.helpers.recovery import SaturatedCores, run_available_now

MALFORMED_EVERY = 500
COUNT = 20_000  # 200 s of event time: the 2-minute watermark closes the first windows


def _setup(settings, spec_path, data_dir):
    specs = load_specs(spec_path)
    p = specs.only_pipeline()
    asyncio.run(provision.apply(settings, specs))
    rows = json.loads((ROOT / "pipelines" / "reference" / "services.json").read_text())
    asyncio.run(reference.put(settings, p.name, "services", rows))
    return specs, p, settings, data_dir


def publish(settings, p, count, start=0):
    r = asyncio.run(produce(settings, p, count=count, seed=7, start=start, malformed_every=MALFORMED_EVERY))
    assert r.published == count


run_steps = run_available_now  # every step (or ``only``) available-now, in this process


def good_ids(count):
    return {f"in/0/{i + 1}" for i in range(count) if not is_malformed(i, MALFORMED_EVERY)}


def check_sinks(data_dir, expected_ids):
    raw = DeltaTable(str(data_dir / "sinks/logs/raw")).to_pyarrow_table()
    ids = raw.column("_isb_id").to_pylist()
    assert len(ids) == len(set(ids)), "duplicate _isb_id in the raw sink"
    assert set(ids) == expected_ids
    check_agg_is_batch_recount(data_dir, raw)


def check_agg_is_batch_recount(data_dir, raw):
    """Every window of agg (open ones too: minutely has output update) equals per_minute's batch
    result over the raw rows, recomputed here in Python: count, errors, mean and p95 latency."""
    agg = DeltaTable(str(data_dir / "sinks/logs/agg")).to_pyarrow_table().to_pylist()
    got = {(r["window_start"].replace(tzinfo=None), r["service"]): r for r in agg}
    assert len(got) == len(agg), "a window twice in agg"
    groups: dict[tuple, list[tuple[float, bool]]] = {}
    for r in raw.select(["ts", "service", "latency_ms", "is_error"]).to_pylist():
        key = (r["ts"].replace(second=0, microsecond=0, tzinfo=None), r["service"])
        groups.setdefault(key, []).append((r["latency_ms"], r["is_error"]))
    assert sorted(set(groups) ^ set(got)) == [], "agg's windows differ from the raw rows' windows"
    for key, rows in groups.items():
        g, lat = got[key], sorted(x for x, _ in rows)
        assert (g["count"], g["errors"]) == (len(rows), sum(e for _, e in rows)), key
        assert g["latency_avg"] == pytest.approx(sum(lat) / len(lat), rel=1e-9), key
        # percentile_approx: the smallest value with at least 95% of values <= it (exact at this size)
        assert g["latency_p95"] == lat[max(math.ceil(0.95 * len(lat)) - 1, 0)], key


def _summary(report):
    raw = next(s for s in report.sinks if s.sink == "raw")
    return (f"low={report.low_offsets['in/0']['low']} replayed={report.replayed_records} raw: inserted="
            f"{raw.inserted} dropped={raw.dropped}; " + ", ".join(f"{ph.name} {ph.seconds:.1f}s" for ph in report.phases)
            + f"; total {report.seconds:.1f}s")


async def _delete_stream(settings, stream):
    nc = await connect(settings)
    try:
        await nc.jetstream().delete_stream(stream)
    finally:
        await nc.close()


async def _detect(settings, p, data_dir):
    nc = await connect(settings)
    try:
        return await detect_loss(nc, p, data_dir)
    finally:
        await nc.close()


# ----------------------------------------------------------------------------- ledger (pure)


def test_ledger_ranges_and_low_offsets():
    ids = pa.array(["in/0/3", "in/0/1", "in/0/2", "in/0/9", "in/1/4", None, "not-an-id"])
    assert ledger.id_ranges(ids) == {"in/0": [[1, 3], [9, 9]], "in/1": [[4, 4]]}
    assert ledger.union({"in/0": [[1, 3]]}, {"in/0": [[4, 6], [8, 8]]}) == {"in/0": [[1, 6], [8, 8]]}
    assert ledger.from_metadata(ledger.to_metadata({"in/0": [[1, 6]]})) == {"in/0": [[1, 6]]}
    assert ledger.from_metadata("{}") == {} and ledger.from_metadata('{"src": {"row": 7}}') == {}
    sinks = {"raw": {"in/0": [[1, 6], [8, 20]]}, "other": {"in/0": [[1, 30]]}}
    low = ledger.low_offsets(sinks, ["in/0"])["in/0"]
    assert (low.low, low.per_sink) == (7, {"raw": 7, "other": 31})
    # a dead-lettered sequence counts as committed
    assert ledger.low_offsets(sinks, ["in/0"], dead={"in/0": [[7, 7]]})["in/0"].low == 21
    # a sink that holds nothing lacks everything from the source's first sequence
    assert ledger.low_offsets({"raw": {}}, ["in/0"], first={"in/0": 5})["in/0"].low == 5
    # overlap of fragmented ranges, in one sweep
    odd = [[i, i] for i in range(1, 200_001, 2)]  # every odd sequence: 100,000 ranges
    assert not ledger.overlaps(odd, [[i, i] for i in range(2, 200_001, 2)])
    assert ledger.overlaps(odd, [[200_000, 200_002], [199_999, 199_999]][1:])
    assert ledger.overlaps([[5, 9]], [[1, 2], [9, 12]]) and not ledger.overlaps([[5, 8]], [[1, 4], [9, 12]])
    assert not ledger.overlaps([], [[1, 2]]) and not ledger.overlaps([[1, 2]], [])


# ----------------------------------------------------------------------------- scenarios


def test_recover_after_edge_stream_deleted(spark, nats_server, tmp_path):
    """Data sits in enrich -> raw when that stream is deleted; recover refills raw exactly, with
    the machine's cores saturated by a bounded local load while it runs (a continuous run beside
    a recovery: new Python workers then miss Spark's connect-back window, which the shared
    restart policy, isbflow.steps.restart, turns into a restart instead of a failed recovery)."""
    specs, p, settings, data_dir = _setup(nats_server.settings, ROOT / "pipelines" / "logs.yaml", tmp_path)
    publish(settings, p, COUNT)
    run_steps(spark, specs, p, settings, data_dir, only=["in", "parse", "enrich"])
    assert asyncio.run(_detect(settings, p, data_dir)) == []
    lost = naming.EdgePartition(p.name, "enrich", "raw", 0).stream
    asyncio.run(_delete_stream(settings, lost))
    assert [b.stream for b in asyncio.run(_detect(settings, p, data_dir))] == [lost]

    # the dry run names the loss and the replay, and changes nothing
    from typer.testing import CliRunner

    from isbflow.cli import app

    r = CliRunner().invoke(app, ["replay", "-f", str(ROOT / "pipelines" / "logs.yaml"), "--mode", "recover",
                                 "--dry-run", "--data-dir", str(data_dir), "--nats-url", nats_server.url, "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert (plan["dry_run"], plan["state"], [b["stream"] for b in plan["lost"]]) == (True, "would-recover", [lost])
    assert plan["records_to_replay"] == COUNT and lost in plan["streams_to_recreate"]
    assert [b.stream for b in asyncio.run(_detect(settings, p, data_dir))] == [lost]  # still lost

    with SaturatedCores(limit_s=180) as load:
        report = recover(spark, specs, p, settings, data_dir)
    load.check()

    print(_summary(report))
    assert report.ok, json.dumps(report.to_json(), default=str)
    assert [b.stream for b in report.lost] == [lost]
    assert [ph.name for ph in report.phases] == ["detect", "drain", "recreate", "rewind", "replay", "verify"]
    assert report.low_offsets["in/0"]["low"] == 1  # no sink had committed anything
    assert report.replayed_records == COUNT
    raw = next(s for s in report.sinks if s.sink == "raw")
    assert (raw.verified, raw.duplicates, raw.missing) == (True, 0, 0)
    assert raw.rows == raw.inserted == len(good_ids(COUNT)) and raw.dropped == 0
    check_sinks(data_dir, good_ids(COUNT))
    # the ledger holds what raw holds, in the KV and in the table's commits
    held = ledger.from_delta_history(str(data_dir / "sinks/logs/raw"))
    assert ledger.count(held["in/0"]) == len(good_ids(COUNT))

    # the pipeline goes on normally after recovery (new checkpoints, new sink app ids)
    publish(settings, p, 2000, start=COUNT)
    run_steps(spark, specs, p, settings, data_dir)
    check_sinks(data_dir, good_ids(COUNT + 2000))
    assert asyncio.run(_detect(settings, p, data_dir)) == []


def test_recover_memory_buffers_after_server_restart(spark, nats_server, tmp_path):
    """Memory edges (R1) vanish with a server restart; the file-backed source stream survives."""
    spec_text = (ROOT / "pipelines" / "logs.yaml").read_text()
    # 8 memory streams must fit the embedded server's 1 GiB memory store
    spec_text = spec_text.replace("storage: file", "storage: memory").replace("maxBytes: 512MiB", "maxBytes: 64MiB")
    spec_text = spec_text.replace(
        "subject: logs.events", "subject: logs.events\n          stream: logs-events")
    spec_path = tmp_path / "logs-memory.yaml"
    spec_path.write_text(spec_text)

    async def source_on_file():
        nc = await connect(nats_server.settings)
        try:
            await nc.jetstream().add_stream(StreamConfig(
                name="logs-events", subjects=["logs.events"], storage=StorageType.FILE, allow_direct=True,
                duplicate_window=120.0))
        finally:
            await nc.close()

    asyncio.run(source_on_file())
    specs, p, settings, data_dir = _setup(nats_server.settings, spec_path, tmp_path)
    publish(settings, p, COUNT)
    run_steps(spark, specs, p, settings, data_dir)  # everything through: raw and agg hold it
    check_sinks(data_dir, good_ids(COUNT))
    publish(settings, p, 3000, start=COUNT)
    run_steps(spark, specs, p, settings, data_dir, only=["in", "parse"])  # in flight: parse -> enrich

    stop_embedded(nats_server.data_dir)
    start_embedded(nats_server.data_dir)
    settings = nats_server.settings
    lost = {b.stream for b in asyncio.run(_detect(settings, p, data_dir))}
    assert {ep.stream for ep in naming.edge_partitions(p)} <= lost
    assert "logs-events" not in lost

    with SaturatedCores(limit_s=180) as load:
        report = recover(spark, specs, p, settings, data_dir)
    load.check()

    print(_summary(report))
    assert report.ok, json.dumps(report.to_json(), default=str)
    low = report.low_offsets["in/0"]["low"]
    assert 1 <= low <= COUNT + 1
    assert not report.source_lost
    raw = next(s for s in report.sinks if s.sink == "raw")
    assert (raw.duplicates, raw.missing) == (0, 0)
    assert raw.inserted == len(good_ids(COUNT + 3000)) - len(good_ids(COUNT))
    check_sinks(data_dir, good_ids(COUNT + 3000))


# ----------------------------------------------------------------------------- the command


def test_replay_command_without_loss_and_with_a_wrong_stream(nats_server):
    """No Spark is started when nothing was lost; a stream that is no buffer is refused by name."""
    from typer.testing import CliRunner

    from isbflow.cli import app

    spec = str(ROOT / "pipelines" / "logs.yaml")
    specs = load_specs(spec)
    asyncio.run(provision.apply(nats_server.settings, specs))
    base = ["replay", "-f", spec, "--data-dir", str(nats_server.data_dir)]
    r = CliRunner().invoke(app, [*base, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["state"], out["lost"], out["ok"]) == ("nothing-lost", [], True)
    # the last recovery shows in the pipeline's status, with its phases
    r = CliRunner().invoke(app, ["pipeline", "status", "-f", spec, "--data-dir", str(nats_server.data_dir), "--json"])
    assert r.exit_code == 0, r.output
    shown = json.loads(r.stdout)["recovery"]
    assert shown["state"] == "nothing-lost" and [ph["name"] for ph in shown["phases"]] == ["detect"]
    r = CliRunner().invoke(app, ["pipeline", "status", "-f", spec, "--data-dir", str(nats_server.data_dir)])
    assert r.exit_code == 0, r.output
    assert "last recovery: nothing-lost" in r.stdout and "lost: nothing; phases: detect done" in r.stdout
    r = CliRunner().invoke(app, [*base, "--lost", "isb-logs-nope-0"])
    assert r.exit_code == 1
    assert "isb-logs-nope-0 is not a buffer of this pipeline" in r.output
    r = CliRunner().invoke(app, [*base, "--mode", "reprocess"])
    assert r.exit_code == 2


def test_status_line_of_a_recovery():
    from isbflow.recovery.status import recovery_line

    now = 1_000_000.0
    done = {"state": "recovered", "updated_at": now - 30, "seconds": 41.5, "replayed_records": 1234,
            "lost": [{"stream": "isb-logs-enrich-raw-0"}],
            "phases": [{"name": "detect", "state": "done", "seconds": 0.2},
                       {"name": "replay", "state": "done", "seconds": 30.04}]}
    assert recovery_line(done, now) == (
        "last recovery: recovered (last update 30s ago); lost: isb-logs-enrich-raw-0; "
        "phases: detect done 0.2s, replay done 30.0s; 1234 records replayed in 41.5s")
    stuck = dict(done, state="running", updated_at=now - 7200)  # another host's: judged by its age
    assert "its process is gone" in recovery_line(stuck, now)
    assert "gone" not in recovery_line(dict(stuck, updated_at=now - 60), now)
    assert "then run 'isbflow replay --mode recover' again" in recovery_line(dict(done, state="failed"), now)


def test_a_recovery_killed_midway_does_not_count_as_running():
    """The watchdog starts no second recovery while one runs, but one whose process died
    (state left at ``running``) must not block it for ever."""
    import os
    import socket
    import subprocess
    import sys
    import time

    from isbflow.recovery.status import is_running

    here = socket.gethostname()
    assert is_running({"state": "running", "pid": os.getpid(), "host": here})
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert not is_running({"state": "running", "pid": gone.pid, "host": here, "updated_at": time.time()})
    assert not is_running({"state": "recovered", "pid": os.getpid(), "host": here})
    assert not is_running(None)
