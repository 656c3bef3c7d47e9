"""Offsets of the ``jetstream`` source: per stream, its incarnation and the last sequence read.

The JSON Spark keeps in the checkpoint's offset log (plain JSON, readable by a
person and by the recovery ledger)::

    {"<stream>": {"inc": "<stream created time>", "seq": <last sequence included>}}

``inc`` (the stream's creation time, see
:class:`isbflow.isb.read.StreamState`) tells incarnations apart: a
deleted and recreated stream restarts its sequences at 1, so a sequence means
nothing without it.

Two optional keys appear on a stream only in the offset that moved it past a
buffer loss (``onBufferLoss=replay``):

- ``"from": <seq>``: that batch reads this stream's ``(from, seq]`` in ``inc``,
  not ``(start.seq, seq]`` (the start offset may name an older incarnation);
- ``"lost": {"first": a, "last": b or null, "reason": "..."}``: what was lost,
  kept in the checkpoint as a record.

:func:`batch_range` is the one rule turning a (start, end) pair into the
sequences a batch reads; :func:`fair_share` splits a read limit across streams;
:func:`task_size` how many messages of a batch one task reads, :func:`replicas` the task slots its
autoscaler gives a step now.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StreamOffset:
    inc: str
    seq: int
    #: set only on the offset that moved past a loss: the batch reads (rebased_from, seq]
    rebased_from: int | None = None
    #: set only with rebased_from: {"first", "last", "reason"} of what was lost
    lost: Mapping[str, Any] | None = None

    def to_json(self) -> dict:
        d: dict[str, Any] = {"inc": self.inc, "seq": self.seq}
        if self.rebased_from is not None:
            d["from"] = self.rebased_from
        if self.lost is not None:
            d["lost"] = dict(self.lost)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StreamOffset:
        return cls(inc=str(d["inc"]), seq=int(d["seq"]),
                   rebased_from=int(d["from"]) if d.get("from") is not None else None,
                   lost=d.get("lost"))


Offsets = dict[str, StreamOffset]


def to_json(offsets: Mapping[str, StreamOffset]) -> dict:
    return {s: o.to_json() for s, o in offsets.items()}


def from_json(d: Mapping[str, Any] | None) -> Offsets:
    return {s: StreamOffset.from_json(o) for s, o in (d or {}).items()}


def batch_range(start: StreamOffset | None, end: StreamOffset) -> tuple[int, int]:
    """The sequences ``(first, last)`` of ``end.inc`` a batch from ``start`` to ``end`` reads.

    Empty (``first > last``) when the stream did not move. A rebased end reads
    from its ``from``; otherwise from after the start's sequence, which must be
    of the same incarnation (a change of incarnation always comes with ``from``).
    """
    if start == end:
        return end.seq + 1, end.seq
    if end.rebased_from is not None:
        return end.rebased_from + 1, end.seq
    if start is None or start.inc != end.inc:
        return end.seq + 1, end.seq
    return start.seq + 1, end.seq


def fair_share(available: Mapping[str, int], cap: int) -> dict[str, int]:
    """Split ``cap`` units across streams, each getting at most what it has available.

    Water-filling in the mapping's order: every stream with data gets an equal
    share, and what a short stream leaves is shared again among the others; the
    total is ``min(cap, sum(available))``. Deterministic.
    """
    take = dict.fromkeys(available, 0)
    active = [s for s, n in available.items() if n > 0]
    remaining = max(0, cap)
    while remaining > 0 and active:
        share = max(1, remaining // len(active))
        for s in list(active):
            give = min(share, available[s] - take[s], remaining)
            take[s] += give
            remaining -= give
            if take[s] >= available[s]:
                active.remove(s)
            if remaining == 0:
                break
    return take


def task_size(counts: Sequence[int], most: int, min_tasks: int, least: int) -> int:
    """Messages per task for a batch of ``counts`` messages per stream: ``most``, or fewer so the batch
    makes at least ``min_tasks`` tasks, but never under ``least`` a task. Measured with
    ``bench/throughput.py --records 2000000`` (A: frames written through into Delta, one buffer
    partition, frames of 10,000 rows, batches of 400K rows, ``local[2]``, one run each): one task a
    batch (40 frames) 461K rec/s, two 664K; the same read in a single 2M-row batch (two tasks) had
    made 972K: the second core had waited. A batch of more than ``most * min_tasks`` is cut into whole
    rounds of ``min_tasks`` (a replay's 5M rows, 500 frames, on 2 slots: 6 tasks of 84, not 5 of 100 whose
    last round runs one task while the other slot waits)."""
    tasks = sum(math.ceil(n / most) for n in counts if n > 0)
    total = sum(n for n in counts if n > 0)
    if total < 2 * least or tasks == min_tasks or min_tasks <= 1:
        return most
    if tasks > min_tasks:  # whole rounds of the task slots: 5 tasks of 100 on 2 slots end after 3 rounds of 100
        rounds = math.ceil(tasks / min_tasks)
        size = max(least, math.ceil(total / (rounds * min_tasks)))
        # the streams' counts round up each: keep the size only if it still makes those rounds
        return size if sum(math.ceil(n / size) for n in counts if n > 0) <= rounds * min_tasks else most
    return max(least, min(most, math.ceil(total / min_tasks)))


def replicas(path: str | None) -> int:
    """The replicas a step's autoscaler wrote to ``path`` (an integer; the reader plans a batch with at
    least that many tasks); 1 when there is no such file or it holds no positive integer. One small
    read per planned batch, on the driver."""
    if not path:
        return 1
    try:
        with open(path) as f:
            return max(1, int(f.read().strip() or 1))
    except (OSError, ValueError):
        return 1
