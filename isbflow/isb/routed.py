"""Offsets routed away from a sink: the ledger's account of conditional forwarding.

A sink fed through an edge with ``conditions.tags`` (the demo's ``errors``) holds
only the records routed to it, so its offset ledger entry has a hole for every
record that went elsewhere: recovery's low offset would stop at the first of them
(a replay from offset 1), and the entry would grow by one range per record it
holds. What fills those holes is the fact that the records will never come.

When every path to a sink passes through one edge with conditions and no other
edge with conditions leads to it (:meth:`isbflow.spec.models.Pipeline.gate`), the
step writing that edge knows which records the sink will never see: those of its
output rows the edge does not take. Its writer tasks compute their ``_isb_id``
ranges (:func:`routed_away`: ids not taken minus ids taken in the same batch, as
one source record may make several rows), and the writer's commit adds them
(:func:`record_routed`, idempotent: a re-run batch adds the same ranges) to the
ledger bucket under ``routed.<sink>.<source>.<partition>``
(:func:`isbflow.isb.ledger.routed_key`), value
``{"ranges": [[first, last], ...], "kept": k, "updated": <unix time>}``.

Readers take a sink's routed ranges as covered beside its own ranges and the dead
letters (recovery's low offsets, :func:`read_routed`). Both entries stay bounded:
the sink's own entry folds the routed offsets inside its span when it grows
(:func:`isbflow.isb.ledger.record`), and a routed entry, whose holes are the records
routed *to* the sink, folds in what the sink's entry holds the same way, so each
keeps one range per record in flight.

A sink behind two edges with conditions, or reachable around the edge, has no
gate: its ledger keeps the holes (recovery replays from the first, and the merge
on ``_isb_id`` absorbs what it already holds).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc

from isbflow.isb import naming
from isbflow.isb.connect import run_kept
from isbflow.isb.control import kv as open_kv
from isbflow.isb.errors import LedgerFull
from isbflow.isb.ledger import (
    FOLD_AT,
    entry_ranges,
    fold_dead,
    ledger_key,
    read,
    routed_key,
)
from isbflow.isb.ranges import PartitionRanges, difference, id_ranges, normalize, union
from isbflow.isb.store import ValueTooLarge


def routed_away(ids: pa.Array | pa.ChunkedArray, taken: pa.Array) -> PartitionRanges:
    """Per source partition, the sequences of ``ids`` whose rows ``taken`` (bool per row) does not
    take, but for those another row of the same id is taken with. Executor side, vectorised."""
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    taken = pc.fill_null(taken, False)
    away = id_ranges(ids.filter(pc.invert(taken)))
    if not away:
        return {}
    kept = id_ranges(ids.filter(taken))
    return {part: d for part, rs in away.items() if (d := difference(rs, kept.get(part, [])))}


async def record_routed(nc, pipeline: str, sinks: Iterable[str], ranges: PartitionRanges) -> None:
    """Add ``ranges`` to the routed entries of each of ``sinks`` (module docstring); an entry that
    has grown folds in the sink's own ranges inside its span. Raises
    :class:`~isbflow.isb.errors.LedgerFull` when an entry is larger than the store takes in one value."""
    kv = await open_kv(nc, naming.ledger_bucket(pipeline))
    limit = kv.max_value
    for sink in sinks:
        for part, rs in ranges.items():
            key = routed_key(sink, part)
            held = json.loads(await kv.get(key) or b"{}")
            merged = normalize([*held.get("ranges", []), *rs])
            kept = int(held.get("kept", 0))
            if len(merged) > max(FOLD_AT, 2 * kept):
                merged, _ = fold_dead(merged, await entry_ranges(kv, ledger_key(sink, part)))
                kept = len(merged)
            value = json.dumps({"ranges": merged, "kept": kept, "updated": time.time()},
                               separators=(",", ":")).encode()
            if len(value) > limit:
                raise LedgerFull(key, len(value), limit, len(merged))
            try:
                await kv.put(key, value)
            except ValueTooLarge:
                raise LedgerFull(key, len(value), limit, len(merged)) from None


def record_routed_sync(settings, pipeline: str, sinks: Iterable[str], ranges: PartitionRanges) -> None:
    """:func:`record_routed` from synchronous code (the jetstream writer's commit, every micro-batch:
    on a kept connection, :func:`isbflow.isb.connect.run_kept`)."""
    sinks = list(sinks)
    run_kept(settings, lambda nc: record_routed(nc, pipeline, sinks, ranges),
             name=f"isbflow-routed-{pipeline}")


async def read_routed(nc, pipeline: str) -> dict[str, PartitionRanges]:
    """Every routed entry: sink -> partition -> ranges (``{}`` when there is none)."""
    return await read(nc, pipeline, kind="routed")


async def read_covered(nc, pipeline: str) -> dict[str, PartitionRanges]:
    """Per sink, what its ledger entries cover: its own ranges with the offsets routed away from
    it (what recovery's low offsets go by; the dead letters are added there)."""
    own, routed = await read(nc, pipeline), await read_routed(nc, pipeline)
    return {sink: union(own.get(sink, {}), routed.get(sink, {})) for sink in own.keys() | routed.keys()}
