"""The offset ledger's KV entries (isbflow.isb.ledger) against a real nats-server: compacted, bounded,
and loud when an entry cannot fit."""

from __future__ import annotations

import asyncio
import json

import pyarrow as pa
import pytest

from isbflow.isb import ledger, naming
from isbflow.isb.connect import session, settings_to_json
from isbflow.isb.dlq import publish_dead_letters
from isbflow.isb.errors import LedgerFull
from isbflow.isb.server import start_embedded, stop_embedded
from isbflow.sinks.delta import DeltaSinkOptions, commit_batch, sink_version, write_batch_files
from isbflow.steps.restart import error_summary, is_transient

PIPE, SINK, PART = "lg", "raw", "in/0"


async def _provision(nc) -> None:
    """The two resources the ledger touches: its KV bucket and the dead-letter stream."""
    js = nc.jetstream()
    await js.create_key_value(bucket=naming.ledger_bucket(PIPE))
    await js.add_stream(name=naming.dlq_stream(PIPE), subjects=[f"isb.{PIPE}.dlq.>"])


async def _entry(nc) -> dict:
    kv = await nc.jetstream().key_value(naming.ledger_bucket(PIPE))
    return json.loads((await kv.get(ledger.ledger_key(SINK, PART))).value)


def test_fold_dead_fills_only_dead_lettered_gaps_inside_the_span():
    ranges = [[1, 4], [6, 9], [12, 20]]
    assert ledger.fold_dead(ranges, [[5, 5], [10, 10], [30, 31]]) == ([[1, 10], [12, 20]], 2)
    assert ledger.fold_dead(ranges, []) == (ranges, 0)
    assert ledger.fold_dead([[5, 9]], [[1, 4]]) == ([[5, 9]], 0)  # below the span: left to low_offsets


def test_a_read_lists_every_sink_and_partition_of_the_bucket(nats_server):
    """ledger.read takes the keys from the bucket's stream subjects (isb.jetstream.kv), not
    nats-py's watcher: every sink and partition recorded comes back, a deleted key does not, and
    an empty or missing bucket reads as nothing."""
    sinks, parts = [f"s{i}" for i in range(6)], [f"in/{p}" for p in range(3)] + ["other.src/0"]

    async def go():
        async with session(nats_server.settings, name="t-ledger-read") as nc:
            missing = await ledger.read(nc, PIPE)
            await _provision(nc)
            empty = await ledger.read(nc, PIPE)
            for i, sink in enumerate(sinks):
                await ledger.record(nc, PIPE, sink, {p: [[1, 10 + i]] for p in parts})
            kv = await nc.jetstream().key_value(naming.ledger_bucket(PIPE))
            await kv.delete(ledger.ledger_key("s5", "in/2"))
            return missing, empty, await ledger.read(nc, PIPE)

    missing, empty, held = asyncio.run(go())
    assert missing == {} and empty == {}
    assert sorted(held) == sinks
    for i, sink in enumerate(sinks):
        want = {p: [[1, 10 + i]] for p in parts if (sink, p) != ("s5", "in/2")}
        assert held[sink] == want, sink


def test_an_entry_with_many_dead_letter_gaps_stays_bounded(nats_server):
    """10,000 offsets, every 20th dead-lettered (500 gaps), committed in 100 batches: the entry folds
    the dead letters and keeps only the gap that is no dead letter (records in flight)."""
    dead = set(range(20, 10_001, 20))
    in_flight = set(range(5001, 5011))  # never committed, never dead-lettered: must stay a gap

    async def go():
        async with session(nats_server.settings, name="t-ledger") as nc:
            await _provision(nc)
            await publish_dead_letters(nc.jetstream(), PIPE, "in", [{"_isb_id": f"in/0/{s}"} for s in sorted(dead)],
                                       reason="not JSON")
            sizes = []
            for b in range(100):
                seqs = [s for s in range(b * 100 + 1, b * 100 + 101) if s not in dead | in_flight]
                got = await ledger.record(nc, PIPE, SINK, ledger.id_ranges(pa.array([f"in/0/{s}" for s in seqs])))
                sizes.append(len(got[PART]))
            return sizes, await _entry(nc), await ledger.read(nc, PIPE)

    sizes, entry, held = asyncio.run(go())
    assert max(sizes) <= ledger.FOLD_AT + 1  # without folding it ends with 500 ranges
    assert len(entry["ranges"]) <= ledger.FOLD_AT + 1
    folded = entry["dead"]
    assert 0 < folded <= len(dead)
    # what the entry covers is exactly the sink's own offsets plus the folded dead letters
    assert ledger.count(entry["ranges"]) == 10_000 - len(dead) - len(in_flight) + folded
    assert ledger.difference(entry["ranges"], [[5001, 5010]]) == entry["ranges"]  # the open gap is kept
    low = ledger.low_offsets(held, [PART], dead={PART: ledger.normalize([[s, s] for s in dead])})[PART]
    assert low.low == 5001


@pytest.fixture
def small_payload_server(tmp_path_factory):
    """A nats-server whose messages hold at most 64 KiB."""
    data_dir = tmp_path_factory.mktemp("isbflow-small")
    start_embedded(data_dir, max_payload=64 * 1024)
    try:
        from isbflow.isb.connect import resolve_settings

        yield resolve_settings(data_dir=data_dir)
    finally:
        stop_embedded(data_dir)


def _gappy(first: int, n: int) -> dict:
    """``n`` single offsets two apart: ``n`` ranges that no dead letter explains."""
    return {PART: [[s, s] for s in range(first, first + 2 * n, 2)]}


def test_an_entry_that_cannot_fit_fails_loudly_and_keeps_the_last_good_value(small_payload_server):
    async def go():
        async with session(small_payload_server, name="t-ledger-full") as nc:
            await _provision(nc)
            await ledger.record(nc, PIPE, SINK, _gappy(1, 100))
            with pytest.raises(LedgerFull) as e:
                await ledger.record(nc, PIPE, SINK, _gappy(1001, 10_000))
            return e.value, await _entry(nc)

    err, entry = asyncio.run(go())
    assert err.key == ledger.ledger_key(SINK, PART) and err.size > err.limit
    assert "max_payload" in str(err) and err.key in str(err)
    assert len(entry["ranges"]) == 100  # the put was refused, not half-written
    assert error_summary(RuntimeError(f"StreamingQueryException: batch 3\nTraceback (most recent call last):\n"
                                      f"  ...\nisbflow.isb.errors.LedgerFull: {err}")).startswith("LedgerFull:")
    assert not is_transient(err)  # the runner fails the step instead of restarting it


def test_a_sink_commit_whose_ledger_cannot_fit_fails(small_payload_server, tmp_path):
    """The Delta commit lands (the table's isb.offsets hold the batch), then the step fails; its retry
    skips the batch and fails again: never a ledger that silently stops advancing."""
    async def prepare():
        async with session(small_payload_server, name="t-ledger-sink") as nc:
            await _provision(nc)
            await ledger.record(nc, PIPE, SINK, _gappy(1, 4500))  # fits, barely

    asyncio.run(prepare())
    opts = DeltaSinkOptions.from_options({"path": str(tmp_path / "t"), "appId": f"{PIPE}/x/{SINK}",
                                          "pipeline": PIPE, "sink": SINK,
                                          "settings": settings_to_json(small_payload_server)})
    ids = pa.table({"_isb_id": [f"in/0/{s}" for s in range(20_001, 22_001, 2)]})
    with pytest.raises(LedgerFull):
        commit_batch(opts, [write_batch_files(opts, ids.to_batches(), 0, 0)], 0)
    assert sink_version(opts.path) == 0
    with pytest.raises(LedgerFull):
        commit_batch(opts, [write_batch_files(opts, ids.to_batches(), 0, 0)], 0)
