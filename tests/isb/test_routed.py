"""Offsets routed away from a sink (isbflow.isb.routed): what a gate edge did not take, computed per
task, recorded in the ledger bucket, read as covered, and bounded on both entries (real nats-server)."""

from __future__ import annotations

import asyncio
import json

import pyarrow as pa

from isbflow.isb import ledger, naming, routed
from isbflow.isb.connect import session
from isbflow.spec import load_specs
from tests.conftest import ROOT

PIPE, SINK, PART = "rt", "errors", "in/0"


def ids(seqs) -> pa.Array:
    return pa.array([f"in/0/{s}" for s in seqs])


def test_routed_away_is_what_the_edge_did_not_take_minus_ids_it_took():
    seqs = list(range(1, 11))
    taken = pa.array([s % 2 == 0 for s in seqs])
    assert routed.routed_away(ids(seqs), taken) == {PART: [[1, 1], [3, 3], [5, 5], [7, 7], [9, 9]]}
    # one source record made two rows, one taken: it may still reach the sink, so it is not routed away
    assert routed.routed_away(ids([1, 1, 2]), pa.array([True, False, False])) == {PART: [[2, 2]]}
    assert routed.routed_away(ids([1, 2]), pa.array([None, True])) == {PART: [[1, 1]]}  # null: not taken
    assert routed.routed_away(pa.array(["x", None]), pa.array([False, False])) == {}  # no source ids


def test_the_gate_of_a_sink_is_its_only_conditional_edge_and_nothing_goes_around_it(tmp_path):
    p = load_specs(ROOT / "pipelines" / "logs.yaml").only_pipeline()
    gate = p.gate("errors")
    assert gate is not None and (gate.from_, gate.to) == ("enrich", "errors")
    assert p.gate("raw") is None and p.gate("agg") is None  # no conditions on their paths
    text = (ROOT / "pipelines" / "logs.yaml").read_text()
    # a path around the conditional edge: errors also gets every record from parse
    around = text.replace("    - from: enrich\n      to: errors\n", "    - from: parse\n      to: errors\n"
                          "    - from: enrich\n      to: errors\n")
    (tmp_path / "around.yaml").write_text(around)
    assert load_specs(tmp_path / "around.yaml").only_pipeline().gate("errors") is None


def test_routed_offsets_fill_the_sinks_holes_and_both_entries_stay_bounded(nats_server):
    """10,000 offsets in 100 batches, every 10th an error routed to the sink, the rest routed away:
    without the routed entry the sink's entry holds 1,000 ranges and its low offset is 1."""
    errors = set(range(10, 10_001, 10))
    in_flight = {5000}  # routed to the sink, not yet committed there: must stay a hole

    async def go():
        async with session(nats_server.settings, name="t-routed") as nc:
            await nc.jetstream().create_key_value(bucket=naming.ledger_bucket(PIPE))
            await nc.jetstream().add_stream(name=naming.dlq_stream(PIPE), subjects=[f"isb.{PIPE}.dlq.>"])
            kv = await nc.jetstream().key_value(naming.ledger_bucket(PIPE))
            sizes = []
            for b in range(100):
                batch = range(b * 100 + 1, b * 100 + 101)
                taken = pa.array([s in errors for s in batch])
                # the gate step's commit first, then the sink's (the order of a live pipeline)
                await routed.record_routed(nc, PIPE, [SINK], routed.routed_away(ids(batch), taken))
                await ledger.record(nc, PIPE, SINK, ledger.id_ranges(ids(s for s in batch if s in errors - in_flight)))
                entries = [json.loads((await kv.get(k)).value) for k in
                           (ledger.ledger_key(SINK, PART), ledger.routed_key(SINK, PART))]
                sizes.append(max(len(e["ranges"]) for e in entries))
            return sizes, entries, await ledger.read(nc, PIPE), await routed.read_covered(nc, PIPE)

    sizes, (own, away), held, covered = asyncio.run(go())
    assert max(sizes) <= ledger.FOLD_AT + 1  # without folding: 1,000 ranges each
    assert own["routed"] > 0  # the sink's entry folded routed offsets in
    assert ledger.low_offsets(held, [PART])[PART].low == 1  # its own entry alone: holes from the start
    low = ledger.low_offsets(covered, [PART])[PART]
    assert low.low == 5000  # covered: everything but the record still in flight
    assert ledger.difference([[1, 10_000]], covered[SINK][PART]) == [[5000, 5000]]
    assert ledger.count(away["ranges"]) >= 10_000 - len(errors)
