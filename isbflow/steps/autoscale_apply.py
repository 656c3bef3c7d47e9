"""The runner's autoscaler: each scaled vertex's decision (:mod:`isbflow.steps.autoscale`), acted on.

A vertex with ``scale`` (not ``disabled``) gets a :class:`~isbflow.steps.autoscale.VertexScaler`
when the runner is made. Its replicas act in two places:

- **task slots**: the replicas are written to ``<data dir>/run/<pipeline>/<vertex>.replicas``,
  which the step's reader reads when it plans a micro-batch (the ``jetstream`` option
  ``replicasFile``): a batch is read by at least that many tasks, each of at least 4 frames or 5,000
  events (:func:`isbflow.connector.offsets.task_size`);
- **executors**, on a cluster master (``spark://...``): the application holds as many executors as
  the largest replicas among its running scaled vertices (its steps share one application). The
  runner asks the cluster manager for that total (``SparkContext.requestTotalExecutors``) and
  releases what is above it, idle executors only, without lowering the total again
  (``killExecutors`` of the scheduler backend, not forced: an executor running a task is left for a
  later look). A local master has no executors to change: its replicas are task slots only, and so
  are they where the application runs with Spark's dynamic allocation
  (``spark.dynamicAllocation.enabled``), which then decides the executors itself.

The autoscaler looks at a step on each of its heartbeats (the continuous loop's, every 2-5 s; an
available-now step that scales beats on the same interval while it runs), from the heartbeat's own
figures: ``rows_total`` for the rate (``processed_rows_per_s``, the last batch's, when no batch ended
within the lookback), ``lag`` (pending per input partition: events of a source
stream, frames of an internal edge). A decision that changes the replicas, or whose outcome differs
from the step's last, is logged at INFO with its inputs (:meth:`Decision.log_line`); one that
repeats the last is logged at DEBUG. The last decision, with counts of changes and the executors,
is the heartbeat's ``replicas`` (``isbflow pipeline status --json``, the Pipelines page, and the
metrics :mod:`isbflow.steps.metrics` exports).

An available-now run's steps run one after the other: a step starts with the replicas the step
before it ended with (within its own bounds), so the executors of a backlog are not released and
asked for again between steps. A continuous run's steps start at their ``min`` (at least 1).
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isbflow.connector.options import DEFAULT_FRAME_ROWS
from isbflow.isb.state import Observed
from isbflow.spec.paths import DataDir
from isbflow.steps.autoscale import Decision, VertexScaler, bounds

if TYPE_CHECKING:
    from isbflow.steps.progress import RunningQuery, StepRun

log = logging.getLogger(__name__)

ENDED = {Observed.DRAINED.value, Observed.STOPPED.value, Observed.FAILED.value}


def dynamic_allocation(sc: Any) -> bool:
    """Whether the application runs with Spark's dynamic allocation (its executors are Spark's to decide)."""
    return str(sc.getConf().get("spark.dynamicAllocation.enabled", "false")).strip().lower() == "true"


class Executors:
    """The application's executors on a cluster master, through the driver's ``SparkContext`` in the JVM."""

    def __init__(self, sc: Any):
        self.jvm = sc._jvm
        self.jsc = sc._jsc.sc()
        self.target: int | None = None

    def ids(self) -> list[str]:
        """The executors registered with the driver now (the driver itself is not one)."""
        text = str(self.jsc.getExecutorIds().mkString(","))
        return sorted((i for i in text.split(",") if i), key=lambda i: (len(i), i))

    def hold(self, n: int) -> list[str]:
        """Ask the cluster manager for ``n`` executors in all and release idle ones above it; the ids released."""
        if n != self.target:
            self.jsc.requestTotalExecutors(n, 0, self.jvm.PythonUtils.toScalaMap(self.jvm.java.util.HashMap()))
            self.target = n
        live = self.ids()
        extra = len(live) - n
        if extra <= 0:
            return []
        scheduler = self.jsc.taskScheduler()
        idle = [i for i in reversed(live) if not scheduler.isExecutorBusy(i)][:extra]
        if not idle:
            return []
        ids = self.jvm.java.util.ArrayList()
        for i in idle:
            ids.add(i)
        # the total stays n (adjustTargetNumExecutors false), a task's failure is not counted, busy ones are kept
        done = self.jsc.schedulerBackend().killExecutors(self.jvm.PythonUtils.toSeq(ids), False, False, False)
        return [i for i in str(done.mkString(",")).split(",") if i]


class Autoscaler:
    """The autoscaler of one runner's steps (module docstring)."""

    def __init__(self, runner: Any, now: float | None = None):
        self.p = runner.p
        self.data_dir = Path(runner.data_dir)
        now = time.monotonic() if now is None else now
        self.scalers: dict[str, VertexScaler] = {}
        for v in self.p.spec.vertices:
            if v.scale is None or v.scale.disabled:
                continue
            limits = v.effective_limits(self.p.spec.limits)
            length = limits.bufferMaxLength or 0
            limit = max(1, math.ceil(length * (limits.bufferUsageLimit or 0) / DEFAULT_FRAME_ROWS))
            capacity = max(1, math.ceil(length / DEFAULT_FRAME_ROWS))
            self.scalers[v.name] = VertexScaler(v.name, v.scale, v.source is not None, limit,
                                                math.floor(capacity * v.scale.targetBufferAvailability / 100), now)
        sc = runner.spark.sparkContext
        cluster = self.scalers and str(sc.master).startswith("spark://")
        self.executors = Executors(sc) if cluster and not dynamic_allocation(sc) else None
        self.active: set[str] = set()
        self._carried: int | None = None  # available-now: the replicas the step before ended with
        self._logged: dict[str, tuple] = {}

    def scales(self, vertex: str) -> bool:
        return vertex in self.scalers

    def replicas_file(self, vertex: str) -> Path:
        return DataDir(self.data_dir).no_wait(self.p.name, vertex).with_suffix(".replicas")

    def reader_options(self, vertex: str) -> dict[str, str]:
        """The ``jetstream`` reader's options of a scaled vertex (its replicas file); none otherwise."""
        return {"replicasFile": str(self.replicas_file(vertex))} if vertex in self.scalers else {}

    def start(self, vertex: str, carry: bool = False, now: float | None = None) -> None:
        """Before ``vertex``'s query starts: its replicas file, and the executors it needs. ``carry``
        (available-now): start with the replicas the step before ended with, within its bounds."""
        sc = self.scalers.get(vertex)
        if sc is None:
            return
        if carry and self._carried is not None:
            lo, hi = bounds(sc.scale)
            sc.current = min(max(self._carried, lo), hi)
        sc.changed_at = time.monotonic() if now is None else now
        self._write(vertex, sc.current)
        self.active.add(vertex)
        self._hold()

    def look(self, run: StepRun, now: float | None = None) -> Decision | None:
        """On ``run``'s heartbeat: decide, act, and put the decision in its status (module docstring)."""
        sc = self.scalers.get(run.vertex)
        status = run.status
        if sc is None or status is None or not run.queries:
            return None
        if str(status.state) in ENDED:
            if run.vertex in self.active:
                self.active.discard(run.vertex)
                self._carried = sc.current
                self._hold()
            return sc.last
        now = time.monotonic() if now is None else now
        before = sc.current
        d = sc.look(now, status.rows_total, [int(status.lag.get(s, 0)) for s in run.queries[0].inputs],
                    float(status.processed_rows_per_s or 0.0))
        d.at = time.time()
        if d.target != before:
            self._write(run.vertex, d.target)
        released = self._hold()
        key = (d.direction, d.why, d.desired, d.target)
        level = logging.INFO if d.target != before or self._logged.get(run.vertex) != key else logging.DEBUG
        self._logged[run.vertex] = key
        log.log(level, "%s%s", d.log_line(), f"; executors released: {', '.join(released)}" if released else "")
        status.replicas = {**d.to_json(), "ups": sc.ups, "downs": sc.downs, "looks": sc.looks,
                           "executors": self._executors()}
        return d

    def _hold(self) -> list[str]:
        """The application's executors: the largest replicas among the running scaled steps."""
        if self.executors is None or not self.active:
            return []
        try:
            return self.executors.hold(max(self.scalers[v].current for v in self.active))
        except Exception as e:  # noqa: BLE001 - the cluster manager refused: the step runs on, said once a change
            log.warning("autoscale: the cluster manager did not take the executors asked for: %s", e)
            return []

    def _executors(self) -> dict[str, Any] | None:
        if self.executors is None:
            return None
        try:
            return {"target": self.executors.target, "live": len(self.executors.ids())}
        except Exception:  # noqa: BLE001 - a status field, best effort
            return {"target": self.executors.target, "live": None}

    def _write(self, vertex: str, replicas: int) -> None:
        path = self.replicas_file(vertex)
        DataDir(self.data_dir).make(path.parent)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(f"{replicas}\n")
        tmp.replace(path)  # the reader never reads a half-written file


def await_query(runner: Any, run: StepRun, rq: RunningQuery, every: float) -> None:
    """An available-now step's ``awaitTermination``; a step the autoscaler scales does its bookkeeping
    and beats every ``every`` seconds meanwhile, so its autoscaler looks at it as it runs."""
    if not runner.autoscaler.scales(run.vertex):
        rq.query.awaitTermination()
        return
    while not rq.query.awaitTermination(every):
        runner._bookkeep(run)
        runner._heartbeat(run)
