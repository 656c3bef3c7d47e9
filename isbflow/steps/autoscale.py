"""The autoscaler's decision: a vertex's desired replicas from what it measured, as Numaflow decides.

Pure (no Spark, no NATS): the runner feeds it (:mod:`isbflow.steps.autoscale_apply` acts on it) and
``isbflow pipeline advise`` reuses :func:`desired_replicas` (:mod:`isbflow.ops.advise`).

A vertex's replicas are the task slots its query gets per micro-batch and, on a cluster master
(``spark://...``), the application's executors. The decision follows Numaflow's autoscaler
(``pkg/reconciler/vertex/scaling``):

- **desired**, per input partition, then the largest taken (:func:`desired_replicas`): a source
  ``round(pending / rate / targetProcessingSeconds * current)``; a udf or sink, on its buffer in
  frames (``limit``: what writers fill before ``onFull``, ``available``: the part
  ``targetBufferAvailability`` keeps free), ``current + replicasPerScaleUp`` when ``pending >=
  limit``, else ``round(available / ((limit - pending) / current))``. A partition with nothing
  pending or no rate says nothing; a partition's answer is at least 1 and at most its pending. With
  nothing pending and no rate at all, the vertex asks for ``min``;
- **bounds**: within ``min``..``max``; a running step keeps at least 1 (``min: 0``, scale to zero,
  stops an idle pipeline's driver instead: not the runner's);
- **changes** (:func:`decide`): a current count outside the bounds moves to the desired at once;
  otherwise a scale-up waits ``scaleUpCooldownSeconds`` after the last change and adds at most
  ``replicasPerScaleUp``, a scale-down waits ``scaleDownCooldownSeconds`` and removes at most
  ``replicasPerScaleDown``; ``disabled: true`` changes nothing.

The inputs are averaged over ``lookbackSeconds`` (:class:`Lookback`): the processing rate is the
rows the step processed in the window over the window's span, the pending count per partition the
mean of the samples in it. A window in which no micro-batch ended (a lookback shorter than a batch)
has no rate of its own: the last batch's processing rate stands in, as in
``isbflow pipeline advise``, so a batch still running is not taken for a step with nothing to do.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from isbflow.spec.scale import Scale

UP, DOWN, NONE = "up", "down", "none"


def go_round(x: float) -> int:
    """Go's ``math.Round`` (halves away from zero), as Numaflow rounds; Python's ``round`` halves to even."""
    return math.floor(x + 0.5)


def desired_replicas(source: bool, scale: Scale, rate: float, pending: list[int], current: int = 1,
                     limit: int = 1, available: int = 1) -> int:
    """Numaflow's desired replicas of a vertex running ``current`` replicas (module docstring), within
    ``scale.min``..``scale.max``: ``pending`` per input partition, ``rate`` its processed rows/s,
    ``limit`` a partition's ``bufferMaxLength * bufferUsageLimit`` and ``available`` its
    ``bufferMaxLength * targetBufferAvailability / 100`` (a udf or sink: in the unit of ``pending``)."""
    if sum(pending) == 0 and rate == 0:
        return scale.min
    current = max(1, current)
    best = 1
    for p in pending:
        if p == 0 or rate == 0:
            continue  # Numaflow: nothing to say about this partition
        if source:
            d = go_round(p / rate / scale.targetProcessingSeconds * current)
        elif p >= limit:
            d = current + scale.replicasPerScaleUp
        else:
            d = go_round(available / ((limit - p) / current))
        best = max(best, min(max(d, 1), p))
    return min(max(best, scale.min), scale.max)


@dataclass
class Decision:
    """One look of the autoscaler at a vertex: its inputs and what it does (``target``)."""

    vertex: str
    pending: list[int]
    rate: float
    current: int
    desired: int  # the formula's answer within the bounds
    target: int  # the replicas from now on (== current: no change)
    min: int
    max: int
    direction: str  # "up", "down" or "none"
    why: str  # the rule that chose target
    cooldown_left_s: float = 0.0  # seconds of the cooldown that held a change back (0: none)
    at: float = 0.0  # when it was decided (time.time())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def log_line(self) -> str:
        """The decision as a log line: its inputs and its outcome."""
        return (f"autoscale {self.vertex}: {self.direction} {self.current} -> {self.target} ({self.why}); "
                f"desired {self.desired} within {self.min}..{self.max}, pending {self.pending}, "
                f"rate {self.rate:,.1f} rows/s, cooldown left {self.cooldown_left_s:.1f}s")


def bounds(scale: Scale) -> tuple[int, int]:
    """The replicas a running step may have: ``min`` (at least 1) to ``max``."""
    lo = max(1, scale.min)
    return lo, max(lo, scale.max)


def decide(vertex: str, scale: Scale, source: bool, pending: list[int], rate: float, current: int,
           since_change_s: float, limit: int = 1, available: int = 1, now: float = 0.0) -> Decision:
    """What the autoscaler does now with a vertex running ``current`` replicas whose last change was
    ``since_change_s`` seconds ago (module docstring)."""
    lo, hi = bounds(scale)
    desired = min(max(desired_replicas(source, scale, rate, pending, current, limit, available), lo), hi)

    def out(target: int, why: str, left: float = 0.0) -> Decision:
        direction = UP if target > current else DOWN if target < current else NONE
        return Decision(vertex, list(pending), round(rate, 3), current, desired, target, lo, hi, direction, why,
                        round(max(0.0, left), 3), now)

    if scale.disabled:
        return out(current, "scale.disabled")
    if current < lo or current > hi:
        return out(desired, "outside min..max")
    if desired > current:
        left = scale.scaleUpCooldownSeconds - since_change_s
        if left > 0:
            return out(current, "scale-up cooldown", left)
        return out(min(desired, current + scale.replicasPerScaleUp), "backlog")
    if desired < current:
        left = scale.scaleDownCooldownSeconds - since_change_s
        if left > 0:
            return out(current, "scale-down cooldown", left)
        return out(max(desired, current - scale.replicasPerScaleDown), "idle capacity")
    return out(current, "at desired")


@dataclass
class Lookback:
    """The samples of one vertex within ``seconds``: (time, rows processed so far, pending per partition)."""

    seconds: float
    samples: deque = field(default_factory=deque)

    def add(self, now: float, rows_total: int, pending: list[int]) -> None:
        self.samples.append((now, rows_total, list(pending)))
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.seconds:
            self.samples.popleft()  # keep one sample at or before the window's start, for the rate

    def rate(self) -> float:
        """Rows processed per second over the window (0 before two samples)."""
        if len(self.samples) < 2:
            return 0.0
        (t0, r0, _), (t1, r1, _) = self.samples[0], self.samples[-1]
        return max(0, r1 - r0) / (t1 - t0) if t1 > t0 else 0.0

    def pending(self) -> list[int]:
        """The mean pending of each partition over the window's samples (rounded up)."""
        if not self.samples:
            return []
        rows = [p for _, _, p in self.samples if len(p) == len(self.samples[-1][2])]
        return [math.ceil(sum(col) / len(rows)) for col in zip(*rows, strict=True)]


class VertexScaler:
    """The autoscaler's state of one vertex: its lookback, its replicas now and its last change."""

    def __init__(self, vertex: str, scale: Scale, source: bool, limit: int = 1, available: int = 1,
                 now: float = 0.0):
        self.vertex, self.scale, self.source = vertex, scale, source
        self.limit, self.available = limit, available
        self.window = Lookback(float(scale.lookbackSeconds))
        self.current = bounds(scale)[0]
        self.changed_at = now
        self.last: Decision | None = None
        self.ups = self.downs = self.looks = 0

    def look(self, now: float, rows_total: int, pending: list[int], last_batch_rate: float = 0.0) -> Decision:
        """Add a sample and decide; a change becomes the current replicas at once. ``last_batch_rate``:
        the rows/s of the step's last micro-batch, the rate when none ended within the window."""
        self.window.add(now, rows_total, pending)
        self.looks += 1
        rate = self.window.rate() or last_batch_rate
        d = decide(self.vertex, self.scale, self.source, self.window.pending(), rate, self.current,
                   now - self.changed_at, self.limit, self.available, now)
        if d.target != self.current:
            self.current, self.changed_at = d.target, now
            if d.direction == UP:
                self.ups += 1
            else:
                self.downs += 1
        self.last = d
        return d
