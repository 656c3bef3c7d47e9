"""The offset ledger: which source offsets each sink has committed.

Every record carries ``_isb_id = <source>/<partition>/<seq>``. A sink learns
the source offsets it holds from the ids of the rows it commits: its writer
tasks compute, per source partition, the sequences of their rows as sorted,
merged inclusive ranges (:func:`id_ranges`, pyarrow, no Python loop per row);
the driver merges the tasks' ranges (:func:`union`) and records them twice,
after the Delta commit:

- in the Delta commit's custom metadata ``isb.offsets`` (the batch's ranges,
  JSON ``{"<source>/<partition>": [[first, last], ...]}``): the table's own
  history, from which the ledger can be rebuilt (:func:`from_delta_history`);
- in the pipeline's ledger KV bucket (:func:`isbflow.isb.naming.ledger_bucket`),
  key ``sink.<sink>.<source>.<partition>``, value
  ``{"ranges": [[first, last], ...], "updated": <unix time>}``: the union of
  every batch the sink has committed (:func:`record`).

The KV is written after the Delta commit: a crash between the two leaves the
ledger behind the table, never ahead of it, so recovery replays too much
(which the sinks' merge on ``_isb_id`` absorbs), never too little.

Ranges have holes where records never reach the sink: dead letters (their
``origin`` id is in the dead-letter buffer, :func:`low_offsets` counts them as
done), records a transform filters out, and records still in flight. The low
offset of a source partition is the first sequence no hole-free prefix of every
``_isb_id`` sink covers: everything below it is in every such sink. A filtering
transform keeps the low offset at its first dropped record: recovery then
replays more than needed, and the merge adds nothing twice.

Sinks whose rows carry no ``_isb_id`` (aggregates) cannot say which source
offsets they hold: they record nothing and do not move the low offset (see
:mod:`isbflow.recovery.recover` for how recovery treats them).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from isbflow.isb import naming
from isbflow.isb.connect import run_with
from isbflow.isb.ranges import (  # noqa: F401 - the ledger's range algebra, used through this module too
    PartitionRanges,
    Ranges,
    count,
    first_gap,
    id_ranges,
    normalize,
    overlaps,
    union,
)

ID_COLUMN = "_isb_id"
OFFSETS_KEY = "isb.offsets"



def to_metadata(ranges: PartitionRanges) -> str:
    """The ``isb.offsets`` value of a Delta commit."""
    return json.dumps(ranges, separators=(",", ":"), sort_keys=True)


def from_metadata(text: str | None) -> PartitionRanges:
    """Inverse of :func:`to_metadata`; anything else (e.g. ``"{}"``, foreign JSON) gives ``{}``."""
    try:
        d = json.loads(text or "{}")
    except (TypeError, ValueError):
        return {}
    if not isinstance(d, dict):
        return {}
    out = {}
    for part, ranges in d.items():
        if isinstance(ranges, list) and all(isinstance(r, list) and len(r) == 2 for r in ranges):
            out[part] = ranges
    return union(out)


def from_delta_history(path: str) -> PartitionRanges:
    """The ranges a Delta sink holds, rebuilt from its commits' ``isb.offsets`` (``{}`` without a table)."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        history = DeltaTable(path).history()
    except TableNotFoundError:
        return {}
    return union(*(from_metadata(h.get(OFFSETS_KEY)) for h in history))


# ------------------------------------------------------------------ the KV bucket


def ledger_key(sink: str, partition: str) -> str:
    """``sink.<sink>.<source>.<partition>`` for partition ``<source>/<partition>``."""
    source, _, index = partition.rpartition("/")
    return f"sink.{sink}.{source}.{index}"


async def record(nc, pipeline: str, sink: str, ranges: PartitionRanges) -> PartitionRanges:
    """Add ``ranges`` to what the ledger holds for ``sink``; return the new totals (per partition given)."""
    from nats.js.errors import KeyNotFoundError, NotFoundError

    kv = await nc.jetstream().key_value(naming.ledger_bucket(pipeline))
    out: PartitionRanges = {}
    for part, rs in ranges.items():
        key = ledger_key(sink, part)
        try:
            entry = await kv.get(key)
            held = json.loads(entry.value or b"{}").get("ranges", [])
        except (KeyNotFoundError, NotFoundError):
            held = []
        merged = normalize([*held, *rs])
        await kv.put(key, json.dumps({"ranges": merged, "updated": time.time()}).encode())
        out[part] = merged
    return out


async def read(nc, pipeline: str) -> dict[str, PartitionRanges]:
    """The whole ledger: sink -> partition -> ranges (``{}`` when the bucket is empty or missing)."""
    from nats.js.errors import BucketNotFoundError, NoKeysError, NotFoundError

    try:
        kv = await nc.jetstream().key_value(naming.ledger_bucket(pipeline))
        keys = await kv.keys()
    except (BucketNotFoundError, NoKeysError, NotFoundError):
        return {}
    out: dict[str, PartitionRanges] = {}
    for key in keys:
        parts = key.split(".")
        if len(parts) < 4 or parts[0] != "sink":
            continue
        sink, source, index = parts[1], ".".join(parts[2:-1]), parts[-1]
        entry = await kv.get(key)
        ranges = json.loads(entry.value or b"{}").get("ranges", [])
        out.setdefault(sink, {})[f"{source}/{index}"] = normalize(ranges)
    return out


def record_sync(settings, pipeline: str, sink: str, ranges: PartitionRanges) -> None:
    """:func:`record` from synchronous code (the Delta sink's driver-side commit)."""


    run_with(settings, lambda nc: record(nc, pipeline, sink, ranges), name=f"isbflow-ledger-{pipeline}-{sink}")


# ------------------------------------------------------------------ low offsets


@dataclass(frozen=True)
class LowOffset:
    """Of one source partition: the first sequence not yet in every ``_isb_id`` sink."""

    partition: str
    low: int  # first sequence to replay; everything below is in every sink (or dead-lettered)
    #: per sink, the first sequence it lacks (what decided ``low``)
    per_sink: dict[str, int]

    def to_json(self) -> dict:
        return {"partition": self.partition, "low": self.low, "per_sink": self.per_sink}


def low_offsets(sinks: Mapping[str, PartitionRanges], partitions: Iterable[str],
                dead: Mapping[str, Iterable[Iterable[int]]] | None = None,
                first: Mapping[str, int] | None = None) -> dict[str, LowOffset]:
    """Per source partition: the lowest sequence not committed by every sink in ``sinks``.

    ``dead`` (partition -> ranges of dead-lettered sequences) counts as committed
    everywhere; ``first`` (partition -> the source stream's first sequence) is
    where counting starts (sequences before it are gone from the source anyway).
    A sink with no ranges for a partition lacks everything from ``first``.
    """
    dead = dead or {}
    out = {}
    for part in partitions:
        start = (first or {}).get(part, 1)
        per = {}
        for sink, ranges in sinks.items():
            covered = normalize([*ranges.get(part, []), *dead.get(part, [])])
            per[sink] = first_gap(covered, start)
        out[part] = LowOffset(part, min(per.values(), default=start), per)
    return out
