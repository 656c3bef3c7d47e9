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
  ``{"ranges": [[first, last], ...], "dead": n, "kept": k, "updated": <unix time>}``:
  the union of every batch the sink has committed (:func:`record`), read and
  rewritten whole by each commit.

**A compacted, bounded entry.** Ranges are merged, so an entry holds one range
per gap. Gaps that can never fill (dead letters, and
offsets a conditional edge routed elsewhere, :mod:`isbflow.isb.routed`) would make
it grow without bound on a long run, so once an entry has more than :data:`FOLD_AT`
ranges (and twice as many as after its last fold, so the dead-letter buffer is
read rarely) :func:`record` folds the dead-lettered and the routed-away offsets
inside its span into its ranges (:func:`fold_dead`) and counts them in ``dead``
and ``routed``. Every reader already counts
dead letters as committed (:func:`low_offsets`; quality subtracts them from what
a sink must hold), so the folded form answers them the same. What stays is one
range per *open* gap (records in flight) or gap that is not a dead letter (a
transform that drops records). An entry that still does not fit in one value of
the store (a NATS message) raises :class:`isbflow.isb.errors.LedgerFull`, which fails the sink's
step: a ledger must never silently stop advancing.

**A bounded log.** Sink maintenance (:mod:`isbflow.sinks.delta_log`) removes old
commits from a Delta sink's log. Before it does, it writes one commit with no
files that carries the union of the ``isb.offsets`` of every commit up to version
``isb.fold.through`` in ``isb.fold.offsets``. Readers of the history
(:func:`history_offsets`) start from the newest such fold and add the commits
after it, so they answer the same before and after the clean-up; a version whose
commits were removed and that no fold covers raises :class:`LogTruncated`, never
a partial answer.

The KV is written after the Delta commit: a crash between the two leaves the
ledger behind the table, never ahead of it, so recovery replays too much
(which the sinks' merge on ``_isb_id`` absorbs), never too little.

Ranges have holes where records never reach the sink: dead letters (their
``origin`` id is in the dead-letter buffer, :func:`low_offsets` counts them as
done), records a conditional edge routed elsewhere (recorded beside the sink's
entry when the edge gates it, :mod:`isbflow.isb.routed`; recovery counts them as
held), records a transform filters out, and records still in flight. The low
offset of a source partition is the first sequence no hole-free prefix of every
``_isb_id`` sink covers: everything below it is in every such sink. A filtering
transform keeps the low offset at its first dropped record: recovery then
replays more than needed, and the merge adds nothing twice.

Sinks whose rows carry no ``_isb_id`` (aggregates) cannot say which source
offsets they hold: they record nothing and do not move the low offset (see
:mod:`isbflow.recovery.recover` for how recovery treats them).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import pyarrow as pa

from isbflow.isb import naming
from isbflow.isb import state as st
from isbflow.isb.buffers import stream_state
from isbflow.isb.connect import run_kept
from isbflow.isb.control import kv as open_kv
from isbflow.isb.dlq import dead_letter_origins
from isbflow.isb.errors import LedgerFull
from isbflow.isb.ranges import (  # noqa: F401 - the ledger's range algebra, used through this module too
    PartitionRanges,
    Ranges,
    count,
    difference,
    first_gap,
    id_ranges,
    is_partition,
    normalize,
    overlaps,
    union,
)
from isbflow.isb.store import BucketMissing, ValueTooLarge

ID_COLUMN = "_isb_id"
OFFSETS_KEY = "isb.offsets"
#: a fold commit's metadata: the last version it covers, and the union of those commits' ``isb.offsets``
FOLD_THROUGH_KEY = "isb.fold.through"
FOLD_OFFSETS_KEY = "isb.fold.offsets"
#: an entry with more ranges than this has its dead-lettered gaps folded in (module docstring)
FOLD_AT = 64


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
    return delta_history_until(path, None)


class LogTruncated(LookupError):
    """A Delta history that no longer reaches back to the version asked for: commits were removed
    from the log and no fold stands for them (module docstring, "A bounded log")."""


def newest_fold(history: Iterable[Mapping], version: int | None = None,
                strict: bool = True) -> tuple[Mapping | None, int]:
    """The commit of ``history`` whose fold (module docstring, "A bounded log") covers the most
    commits, all of them at or before ``version`` (any when None; the fold commit itself may be
    newer: it changes no data), and the last version it covers: ``(None, -1)`` when there is none.
    Raises :class:`LogTruncated` when commits before the history's first are covered by no such fold
    (unless not ``strict``: sink maintenance folds what is left of a log cleaned outside it)."""
    history = list(history)
    best, through = None, -1
    for h in history:
        t = h.get(FOLD_THROUGH_KEY)
        if t is not None and through < int(t) and (version is None or int(t) <= version):
            best, through = h, int(t)
    first = min((int(h.get("version", 0)) for h in history), default=0)
    if strict and first > through + 1:
        raise LogTruncated(
            f"the Delta log starts at version {first} and no fold covers the versions before it"
            + (f" up to version {version}" if version is not None else "")
            + ": they were removed (older than the log retention, or cleaned outside isbflow's maintenance); "
            "read a newer version")
    return best, through


def history_offsets(history: Iterable[Mapping], version: int | None = None,
                    strict: bool = True) -> PartitionRanges:
    """The union of the ``isb.offsets`` of a Delta history's commits up to ``version`` (all when
    None), through the newest fold that covers only such commits (module docstring; ``strict``:
    :func:`newest_fold`'s)."""
    history = list(history)
    fold, through = newest_fold(history, version, strict)
    last = version if version is not None else 1 << 62
    return union(from_metadata(fold.get(FOLD_OFFSETS_KEY)) if fold is not None else {},
                 *(from_metadata(h.get(OFFSETS_KEY)) for h in history if through < int(h.get("version", 0)) <= last))


# ------------------------------------------------------------------ the KV bucket


def ledger_key(sink: str, partition: str) -> str:
    """``sink.<sink>.<source>.<partition>`` for partition ``<source>/<partition>``."""
    source, _, index = partition.rpartition("/")
    return f"sink.{sink}.{source}.{index}"


def routed_key(sink: str, partition: str) -> str:
    """``routed.<sink>.<source>.<partition>``: offsets routed away from ``sink`` (:mod:`isbflow.isb.routed`)."""
    source, _, index = partition.rpartition("/")
    return f"routed.{sink}.{source}.{index}"


async def entry_ranges(kv, key: str) -> Ranges:
    """The ``ranges`` of a ledger KV entry (``[]`` when it is missing)."""
    return normalize(json.loads(await kv.get(key) or b"{}").get("ranges", []))


def fold_dead(ranges: Ranges, dead: Ranges) -> tuple[Ranges, int]:
    """``ranges`` with the dead-lettered offsets inside their span filled in, and how many were
    filled (both sorted and merged; one sweep). Pure."""
    if not ranges or not dead:
        return ranges, 0
    lo, hi = ranges[0][0], ranges[-1][1]
    inside = [[max(a, lo), min(b, hi)] for a, b in dead if b >= lo and a <= hi]
    filled = difference(inside, ranges)
    return (normalize([*ranges, *filled]), count(filled)) if filled else (ranges, 0)


async def record(nc, pipeline: str, sink: str, ranges: PartitionRanges) -> PartitionRanges:
    """Add ``ranges`` to what the ledger holds for ``sink``; return the new totals (per partition given).

    Folds dead-lettered gaps when an entry has grown (module docstring). Raises
    :class:`~isbflow.isb.errors.LedgerFull` when an entry is larger than the store takes in one value.
    """
    kv = await open_kv(nc, naming.ledger_bucket(pipeline))
    limit = kv.max_value
    dead: PartitionRanges | None = None  # read once, when an entry needs folding
    out: PartitionRanges = {}
    for part, rs in ranges.items():
        key = ledger_key(sink, part)
        held = json.loads(await kv.get(key) or b"{}")
        merged = normalize([*held.get("ranges", []), *rs])
        folded, kept, routed = int(held.get("dead", 0)), int(held.get("kept", 0)), int(held.get("routed", 0))
        if len(merged) > max(FOLD_AT, 2 * kept):
            if dead is None:
                dead = dead_letter_ranges(await dead_letter_origins(nc, pipeline))
            merged, n = fold_dead(merged, dead.get(part, []))
            # offsets a conditional edge routed elsewhere never reach the sink either (isb.routed)
            merged, r = fold_dead(merged, await entry_ranges(kv, routed_key(sink, part)))
            folded, kept, routed = folded + n, len(merged), routed + r
        value = json.dumps({"ranges": merged, "dead": folded, "kept": kept, "updated": time.time(),
                            **({"routed": routed} if routed else {})}, separators=(",", ":")).encode()
        if len(value) > limit:
            raise LedgerFull(key, len(value), limit, len(merged))
        try:
            await kv.put(key, value)
        except ValueTooLarge:
            raise LedgerFull(key, len(value), limit, len(merged)) from None
        out[part] = merged
    return out


async def read(nc, pipeline: str, kind: str = "sink") -> dict[str, PartitionRanges]:
    """The whole ledger: sink -> partition -> ranges (``{}`` when the bucket is empty or missing);
    ``kind="routed"``: the offsets routed away from each sink instead (:mod:`isbflow.isb.routed`)."""
    try:
        kv = await open_kv(nc, naming.ledger_bucket(pipeline))
        keys = await kv.keys()
    except BucketMissing:
        return {}
    out: dict[str, PartitionRanges] = {}
    for key in keys:
        parts = key.split(".")
        if len(parts) < 4 or parts[0] != kind:
            continue
        sink, source, index = parts[1], ".".join(parts[2:-1]), parts[-1]
        raw = await kv.get(key)
        if raw is None:  # deleted or purged: JetStream keeps a marker on its subject
            continue
        ranges = json.loads(raw or b"{}").get("ranges", [])
        out.setdefault(sink, {})[f"{source}/{index}"] = normalize(ranges)
    return out


def record_sync(settings, pipeline: str, sink: str, ranges: PartitionRanges) -> None:
    """:func:`record` from synchronous code (the Delta sink's driver-side commit, every micro-batch:
    on a kept connection, :func:`isbflow.isb.connect.run_kept`)."""
    run_kept(settings, lambda nc: record(nc, pipeline, sink, ranges), name=f"isbflow-ledger-{pipeline}")


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


# ------------------------------------------------------------------ what a sink must hold


def first_of(ranges: Ranges, n: int) -> list[int]:
    """The first ``n`` sequences ``ranges`` cover."""
    out: list[int] = []
    for lo, hi in ranges:
        out.extend(range(lo, min(hi, lo + n - len(out) - 1) + 1))
        if len(out) >= n:
            break
    return out


def dead_letter_ranges(origins: Iterable[str | None]) -> PartitionRanges:
    """Per source partition, the sequences of dead-lettered records (their ``origin`` ids)."""
    return id_ranges(pa.array([o for o in origins if o], pa.string()))


def delta_history_until(path: str, version: int | None) -> PartitionRanges:
    """:func:`history_offsets` of the Delta table at ``path`` (``{}`` without a table)."""
    # lazy: delta-rs (a 134 MB native library) loads only where a Delta table is read, not in the
    # CLI or Airflow's DAG parsing, which import isb/
    from deltalake.exceptions import TableNotFoundError

    from isbflow.local.delta import load_table, table_history

    try:
        history = table_history(load_table(path))
    except TableNotFoundError:
        return {}
    return history_offsets(history, version)


def sink_ranges(kv: Mapping[str, PartitionRanges], sink: str, path: str | None,
                version: int | None = None) -> PartitionRanges:
    """What the ledger says sink ``sink`` committed: its KV ranges united with its Delta history's
    (up to table version ``version``)."""
    return union(kv.get(sink, {}), delta_history_until(path, version) if path else {})


# ------------------------------------------------------------------ the committed low watermark

#: a step whose heartbeat is older than this is not running: nobody will move its committed offsets
LIVE_HEARTBEAT_S = 30.0


@dataclass(frozen=True)
class StepBehind:
    """Why a walk stopped at ``vertex``: its committed offsets below what its inputs held (stream ->
    (committed, needed)), or another reason."""

    vertex: str
    reason: str
    streams: dict[str, tuple[int, int]]

    def to_json(self) -> dict:
        return {"vertex": self.vertex, "reason": self.reason,
                "streams": {s: {"committed": c, "needed": n} for s, (c, n) in self.streams.items()}}


@dataclass(frozen=True)
class CommittedWatermark:
    """Of one sink: the source offsets every step from the source to the sink has committed.

    ``committed``: per source partition (``<source>/0``), the offset the source step had
    committed when the walk started. ``confirmed``: every step after it, in topological
    order, was then seen to have committed at least what its input buffers held once the
    step before it was confirmed, so every record up to ``committed`` has passed every
    step and is in the sink. Otherwise ``behind`` names the first step that had not, and
    ``committed`` proves nothing. ``marks``: what ``on_confirmed`` returned per step.
    """

    sink: str
    committed: dict[str, int]
    confirmed: bool
    behind: StepBehind | None = None
    steps: tuple[str, ...] = ()
    marks: dict[str, object] | None = None

    def to_json(self) -> dict:
        return {"sink": self.sink, "committed": self.committed, "confirmed": self.confirmed,
                "behind": self.behind.to_json() if self.behind else None, "steps": list(self.steps)}


async def committed_watermarks(nc, p, sinks: Iterable[str], *, wait_s: float = 30.0, poll_s: float = 0.5,
                               on_confirmed=None) -> dict[str, CommittedWatermark]:
    """Per sink of pipeline ``p`` (a :class:`~isbflow.spec.models.Pipeline`), its :class:`CommittedWatermark`.

    The walk reads each JetStream source step's committed source offset first, then,
    step by step in topological order, the last sequences of a step's input buffers
    (only once every step before it is confirmed) and waits until the step's committed
    offsets (``committed.<vertex>.<stream>``, :mod:`isbflow.isb.state`) reach them:
    then everything the source step had committed has passed this step too. A running
    step gets at most ``wait_s`` seconds to get there (one or two micro-batches); a step
    whose heartbeat says it does not run is judged at once. Files sources keep no
    committed source offset: their sinks are never confirmed. ``on_confirmed(vertex)``
    runs as each step is confirmed (before the next step's buffers are read); its
    result lands in ``marks``.
    """
    sinks = list(sinks)
    chains = {s: p.ancestors(s) | {s} for s in sinks}
    order = [v for v in p.topological_order() if any(v in c for c in chains.values())]
    start: dict[str, dict[str, int]] = {}
    confirmed: set[str] = set()
    behind: dict[str, StepBehind] = {}
    marks: dict[str, object] = {}
    for v in order:
        vertex = p.vertex(v)
        if vertex.source is not None:
            if vertex.source.jetstream is None:
                behind[v] = StepBehind(v, "a files source keeps no committed source offset", {})
                continue
            stream = naming.source_stream(p, v)
            start[v] = {f"{v}/0": await st.get_committed(nc, p.name, v, stream) or 0}
        else:
            ups = sorted({e.from_ for e in p.inputs(v)} - confirmed)
            if ups:
                behind[v] = behind.get(ups[0]) or StepBehind(v, f"step {ups[0]!r} is not confirmed", {})
                continue
            lag = await _catch_up(nc, p, v, wait_s, poll_s)
            if lag is not None:
                behind[v] = lag
                continue
        confirmed.add(v)
        if on_confirmed is not None:
            marks[v] = on_confirmed(v)
    out = {}
    for s in sinks:
        steps = tuple(v for v in order if v in chains[s])
        committed = {part: seq for v in steps if v in start for part, seq in start[v].items()}
        first = next((behind[v] for v in steps if v in behind), None)
        out[s] = CommittedWatermark(s, committed, first is None, first, steps,
                                    {v: marks[v] for v in steps if v in marks})
    return out


async def _catch_up(nc, p, vertex: str, wait_s: float, poll_s: float) -> StepBehind | None:
    """Wait until ``vertex`` has committed what its input buffers hold now; None when it has."""
    streams = [ep.stream for ep in naming.edge_partitions(p) if ep.to_vertex == vertex]
    needed: dict[str, int] = {}
    for s in streams:
        info = await stream_state(nc, s)
        if info is None:
            return StepBehind(vertex, f"its input buffer {s} does not exist", {})
        needed[s] = info.last_seq
    deadline = time.monotonic() + wait_s
    while True:
        got = {s: await st.get_committed(nc, p.name, vertex, s) or 0 for s in streams}
        lag = {s: (got[s], n) for s, n in needed.items() if got[s] < n}
        if not lag:
            return None
        status = await st.get_status(nc, p.name, vertex)
        live = (status is not None and status.age() < LIVE_HEARTBEAT_S
                and status.state in (st.Observed.STARTING, st.Observed.RUNNING, st.Observed.DRAINING))
        if not live:
            return StepBehind(vertex, "it has not committed what its input buffers hold and is not running", lag)
        if time.monotonic() >= deadline:
            return StepBehind(vertex, f"it was still behind its input buffers after {wait_s:g}s", lag)
        await asyncio.sleep(poll_s)
