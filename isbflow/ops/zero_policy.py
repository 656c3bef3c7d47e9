"""When a pipeline may scale to zero, and when it is idle long enough to: the watcher's rules.

Numaflow's ``scale.min: 0`` lets a vertex's replicas go to zero when nothing is pending for it.
isbflow runs a pipeline's steps in one Spark driver, so the pipeline sleeps as a whole: its driver
is drained away only when **every** vertex allows zero, and it wakes when a source grows.

- :func:`refusal`: why a pipeline cannot scale to zero (None when it can): every vertex needs a
  ``scale`` with ``min: 0`` (Numaflow's default once ``scale`` is given) and without
  ``disabled: true``, and every source must be a JetStream source (its stream's growth is what
  wakes the pipeline; a files source cannot be watched without Spark).
- :func:`policy`: the watcher's numbers, from Numaflow's fields: the pipeline sleeps after
  ``scaleDownCooldownSeconds`` (the largest of its vertices') with nothing pending, as a
  one-replica Numaflow vertex goes to zero one cooldown after its pending count reached zero;
  asleep, it looks at its sources again at least every ``zeroReplicaSleepSeconds`` (the smallest
  of its source vertices'), Numaflow's peek, without starting Spark. A source stream isbflow
  created wakes the watcher at once when it stores a message (:mod:`isbflow.isb.wait`); the peek
  is what finds data in a stream that cannot be waited on (one the spec names).
- :class:`IdleClock`: how long the pipeline has been idle, from successive :class:`Look` s: idle
  means no buffer pending (every source stream and edge buffer committed by its reader up to its
  last message), every step running, and no step finished a micro-batch since the last look.
  Anything else starts the clock again.

Pure: no NATS, no Spark; the watcher (:mod:`isbflow.ops.zero`) feeds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from isbflow.spec.models import Pipeline

__all__ = ["IdleClock", "Look", "ZeroPolicy", "policy", "refusal"]


def refusal(p: Pipeline) -> str | None:
    """Why ``p`` cannot scale to zero, naming the vertex and the field; None when it can."""
    for v in p.spec.vertices:
        where = f"pipeline {p.name!r}: vertex {v.name!r}"
        if v.scale is None:
            return (f"{where} has no scale: scale to zero needs every vertex to allow it "
                    "(scale: {min: 0})")
        if v.scale.disabled:
            return f"{where} has scale.disabled: true: its replicas stay as they are, never zero"
        if v.scale.min > 0:
            return f"{where} has scale.min: {v.scale.min}: it keeps at least one replica, so the driver never stops"
        if v.source is not None and v.source.jetstream is None:
            return (f"{where} is a files source: only a JetStream source's growth can wake a pipeline "
                    "without Spark")
    return None


@dataclass(frozen=True)
class ZeroPolicy:
    """The watcher's numbers for one pipeline (module docstring)."""

    idle_seconds: float  # nothing pending this long: drain the driver away
    peek_seconds: float  # asleep: look at the sources at least this often
    look_seconds: float  # awake: how often to look at the buffers and heartbeats

    def to_json(self) -> dict:
        return {"idle_seconds": self.idle_seconds, "peek_seconds": self.peek_seconds,
                "look_seconds": self.look_seconds}


def policy(p: Pipeline) -> ZeroPolicy:
    """``p``'s :class:`ZeroPolicy`; raises ValueError with :func:`refusal`'s reason when it cannot
    scale to zero."""
    why = refusal(p)
    if why is not None:
        raise ValueError(why)
    scales = [v.scale for v in p.spec.vertices if v.scale is not None]
    sources = [v.scale for v in p.spec.vertices if v.source is not None and v.scale is not None]
    idle = float(max(s.scaleDownCooldownSeconds for s in scales))
    peek = float(min(s.zeroReplicaSleepSeconds for s in sources or scales))
    # a few looks per idle window, so a pipeline sleeps within a quarter window of going idle;
    # never more than one a second (each look is a round trip per buffer), never fewer than one per 5 s
    look = min(5.0, max(1.0, idle / 4))
    return ZeroPolicy(idle, peek, look)


@dataclass
class Look:
    """One look at a pipeline: each buffer's pending messages, each step's state and last batch."""

    at: float  # monotonic seconds
    pending: dict[str, int] = field(default_factory=dict)  # stream -> messages not committed by its reader
    states: dict[str, str] = field(default_factory=dict)  # vertex -> observed state ("unknown": no heartbeat)
    batches: dict[str, int] = field(default_factory=dict)  # vertex -> last batch id

    def busy(self) -> list[str]:
        """What keeps the pipeline awake in this look alone, one phrase each (empty: nothing)."""
        out = [f"{s} has {n} pending" for s, n in sorted(self.pending.items()) if n > 0]
        out += [f"step {v} is {s}" for v, s in self.states.items() if s != "running"]
        return out

    def to_json(self) -> dict:
        return {"pending": self.pending, "states": self.states, "batches": self.batches}


class IdleClock:
    """Seconds a pipeline has been idle (module docstring), fed one :class:`Look` at a time."""

    def __init__(self) -> None:
        self.since: float | None = None  # when the current idle stretch began
        self.last: Look | None = None
        self.why: list[str] = ["not looked at yet"]  # what kept it busy at the last look (empty: idle)

    def feed(self, look: Look) -> float:
        """Take ``look``; the seconds the pipeline has been idle up to it (0 when busy)."""
        why = look.busy()
        if self.last is not None:
            why += [f"step {v} finished batch {b}" for v, b in sorted(look.batches.items())
                    if self.last.batches.get(v, b) != b]
        self.last, self.why = look, why
        if why:
            self.since = None
            return 0.0
        if self.since is None:
            self.since = look.at
        return look.at - self.since

    def reset(self) -> None:
        self.since, self.last, self.why = None, None, ["not looked at yet"]
