"""What recover and reprocess share: one job's connection, its phases, its report in the status bucket.

A :class:`RecoveryJob` holds the ISB connection of one run (a
:class:`~isbflow.isb.connect.SyncSession`), times and logs each phase
(:meth:`RecoveryJob.phase`) and publishes the report after every phase under
its key of the pipeline's status bucket (``recovery`` or ``reprocess``), where
``isbflow pipeline status`` and the Pipelines page read it. Publishing is best
effort: the report is also returned to the caller.

Also here: the heartbeat ages both use to tell a running step from a gone one
(:func:`running_steps`), the region a loss or a range touches (:func:`region_of`), and the columns an
aggregate sink is merged by (:func:`dimension_columns`).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from isbflow.isb import naming, reference
from isbflow.isb import state as st
from isbflow.isb.connect import NatsSettings, SyncSession
from isbflow.isb.control import kv as open_kv
from isbflow.local.files import keep_newest
from isbflow.spec.models import Pipeline

log = logging.getLogger(__name__)
T = TypeVar("T")

#: a heartbeat younger than this means the step still runs
RUNNING_HEARTBEAT_S = 30.0
#: while draining, a step whose heartbeat has not moved for this long is taken as gone
#: (its driver was killed); runners beat every 2-5 s (isbflow.steps.runner.heartbeat_interval_s)
SILENT_HEARTBEAT_S = 15.0


def running_steps(statuses: dict, now: float | None = None) -> list[str]:
    """The steps of ``statuses`` (vertex -> StepStatus or None) that still run: a heartbeat younger
    than :data:`RUNNING_HEARTBEAT_S` in state running or draining. (A runner whose step fails
    reports its other steps ``stopped``; a killed driver's heartbeats go stale.)"""
    return [v for v, s in statuses.items() if s is not None and s.age(now) < RUNNING_HEARTBEAT_S
            and s.state in (st.Observed.RUNNING, st.Observed.DRAINING)]


@dataclass
class Phase:
    name: str
    state: str  # done | skipped | failed
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)


class Report(Protocol):
    """What a job's report offers (:class:`~isbflow.recovery.recover.RecoveryReport`,
    :class:`~isbflow.recovery.reprocess.ReprocessReport`)."""

    pipeline: str
    phases: list[Phase]
    seconds: float
    state: str

    def to_json(self) -> dict: ...


class RecoveryJob:
    """One recover or reprocess run of ``pipeline``: its connection, phases and published report.

    ``verb`` names the run in the log and the connection; ``status_key`` is the report's key in
    the status bucket; ``on_phase`` is called with every phase as it ends.
    """

    def __init__(self, settings: NatsSettings, pipeline: Pipeline, report: Report, *, verb: str,
                 status_key: str, on_phase: Callable[[Phase], None] | None = None,
                 recorded: tuple[type[BaseException], ...] = ()):
        self.p, self.report, self.verb, self.status_key = pipeline, report, verb, status_key
        self.on_phase = on_phase
        self.recorded = recorded
        self.closers: list[Callable[[], None]] = []
        self.session = SyncSession(settings, name=f"isbflow-{verb}-{pipeline.name}")
        self.started = time.monotonic()
        self.connected = False

    @property
    def nc(self):
        """The connection (opened on first use; :meth:`connect` opens it explicitly)."""
        nc = self.session.nc
        self.connected = True
        return nc

    def connect(self) -> None:
        self.nc  # noqa: B018 - open it now: an unreachable ISB service fails the run here

    def run(self, coro: Awaitable[T]) -> T:
        """Run a coroutine (made with :attr:`nc`) on the job's loop."""
        return self.session.run(coro)

    def publish(self) -> None:
        """The report as it stands, under ``status_key`` (best effort; never before connecting)."""
        self.report.seconds = round(time.monotonic() - self.started, 3)
        if hasattr(self.report, "updated_at"):
            self.report.updated_at = time.time()
        if not self.connected:
            return
        try:
            kv = self.run(open_kv(self.nc, naming.status_bucket(self.p.name)))
            self.run(kv.put(self.status_key, json.dumps(self.report.to_json(), default=str).encode()))
        except Exception as e:  # noqa: BLE001 - status is best effort; the report is returned
            log.warning("%s %s: could not publish status (%s)", self.verb, self.p.name, e)

    def phase(self, name: str, state: str, started: float, **detail: Any) -> Phase:
        """Record phase ``name`` (begun at monotonic ``started``), log it and publish the report."""
        ph = Phase(name, state, round(time.monotonic() - started, 3), detail)
        self.report.phases.append(ph)
        log.info("%s %s: %s %s (%.1fs) %s", self.verb, self.p.name, name, state, ph.seconds, detail)
        self.publish()
        if self.on_phase:
            self.on_phase(ph)
        return ph

    def failed(self, error: BaseException, *, recorded: bool = False) -> None:
        """The run failed with ``error``: the report says so (an ``error`` phase unless a phase
        already ``recorded`` it) and is published."""
        self.report.state = "failed"
        if not recorded:
            text = (str(error) or type(error).__name__).splitlines()[0][:500]
            self.report.phases.append(Phase("error", "failed", 0.0, {"error": text}))
        self.publish()

    def close(self) -> None:
        self.session.close()

    def own(self, thing: T) -> T:
        """``thing`` (a run holding resources) is closed with the job, before its connection."""
        self.closers.append(thing.close)  # type: ignore[attr-defined]
        return thing

    # The one lifecycle of recover, reprocess and promote: ``with RecoveryJob(...) as job:``.
    # An error leaving the block fails the report (an ``error`` phase unless it is one of the
    # ``recorded`` kinds, whose phase already says so) and propagates; what the job owns and its
    # connection are closed either way.
    def __enter__(self) -> RecoveryJob:
        return self

    def __exit__(self, kind, error, tb) -> None:
        try:
            if error is not None:
                self.failed(error, recorded=isinstance(error, self.recorded))
        finally:
            try:
                for close in reversed(self.closers):
                    close()
            finally:
                self.close()


# ------------------------------------------------------------------ the region


def ancestor_sources(p: Pipeline, vertices: set[str]) -> set[str]:
    """The source vertices upstream of ``vertices`` (themselves included)."""
    seen = set(vertices)
    for v in vertices:
        seen |= p.ancestors(v)
    return {v for v in seen if p.vertex(v).source is not None}


def downstream(p: Pipeline, roots: set[str]) -> set[str]:
    """``roots`` and every vertex below them."""
    out = set(roots)
    for v in roots:
        out |= p.descendants(v)
    return out


async def missing_references(conn: Any, p: Pipeline, steps: list[str]) -> list[tuple[str, str]]:
    """``(step, table)`` for each reference table one of ``steps`` joins that no longer exists on the
    ISB service: a store that lost its buffers (a Redis restarted empty, a flush) lost the tables
    kept beside them too, and a replay through that step would fail after the rewind."""
    return [(v, ref.name) for v in steps if p.vertex(v).udf is not None for ref in p.vertex(v).udf.references
            if await reference.current_revision(conn, p.name, ref.name) is None]


def references_refusal(verb: str, p: Pipeline, missing: list[tuple[str, str]]) -> str:
    names = ", ".join(f"'{name}' (step {v})" for v, name in missing)
    return (f"{verb} {p.name}: reference table {names} no longer exists on the ISB service (lost with the "
            f"buffers?); nothing was changed: put it again with 'isbflow ref put -f <spec> --name "
            f"{missing[0][1]} --from-file <rows.json>', then run {verb} again")


def region_of(p: Pipeline, lost_streams: set[str]) -> tuple[set[str], set[str]]:
    """(sources to rewind, vertices to replay) for buffers ``lost_streams``.

    Fixpoint: the sources upstream of a lost buffer are rewound; everything
    downstream of them is replayed; a source feeding a replayed step is rewound
    too (its records share the recreated buffers).
    """
    touched: set[str] = set()
    for ep in naming.edge_partitions(p):
        if ep.stream in lost_streams:
            touched.add(ep.from_vertex)
    for v in p.spec.vertices:
        if v.source is not None and v.source.jetstream is not None and naming.source_stream(p, v.name) in lost_streams:
            touched.add(v.name)
    sources = ancestor_sources(p, touched)
    while True:
        region = downstream(p, sources)
        more = ancestor_sources(p, region) - sources
        if not more:
            return sources, region
        sources |= more


def dimension_columns(schema) -> list[str]:
    """The non-numeric columns of an aggregate sink's schema: what its rows are merged by."""
    from pyspark.sql.types import (  # lazy: pyspark (0.3-1 s); recovery.job imports without Spark
        BooleanType,
        DecimalType,
        DoubleType,
        FloatType,
        IntegralType,
    )

    numeric = (IntegralType, FloatType, DoubleType, DecimalType, BooleanType)
    return [f.name for f in schema.fields if not isinstance(f.dataType, numeric)]


# ------------------------------------------- checkpoints moved aside, never deleted


def aside_dir(parent: Path, stamp: str) -> Path:
    """``parent/_recovered-<stamp>``, made unique (two recoveries within one second)."""
    d, n = parent / f"_recovered-{stamp}", 1
    while d.exists():
        n += 1
        d = parent / f"_recovered-{stamp}-{n}"
    return d



#: recoveries whose moved-aside checkpoints (and stats) are kept per pipeline; older ones are removed
RECOVERED_KEPT = 5


def prune_aside(parent: Path, keep: int = RECOVERED_KEPT) -> list[str]:
    """Keep the ``keep`` newest ``_recovered-*`` folders under ``parent``; the folders removed.
    They are there to look at after a recovery (its rewind never needs them again)."""
    return [str(p) for p in keep_newest(parent.glob("_recovered-*"), keep)] if parent.is_dir() else []


def move_aside(paths: list[Path], into: Path) -> list[str]:
    """Move each of ``paths`` that exists into ``into`` (made when needed); the paths moved."""
    moved = []
    for src in paths:
        if src.exists():
            into.mkdir(parents=True, exist_ok=True)
            shutil.move(str(src), str(into / src.name))
            moved.append(str(src))
    return moved
