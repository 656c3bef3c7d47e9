"""Recover a pipeline after buffer loss: the result is the one an uninterrupted run gives.

:func:`recover` runs these phases, each logged, timed and published in the
pipeline's status bucket (key ``recovery``, the JSON of :class:`RecoveryReport`):

1. **detect** (:func:`detect_loss`, or the streams given): a buffer is lost
   when its stream is missing, or is another incarnation than the one its
   reading step's checkpoint names, or its first sequence moved past that
   checkpoint's offset. Nothing lost: recover stops here. A step of the
   region whose reference table no longer exists (a store that lost its
   buffers lost the tables kept beside them) is refused here, before anything
   changes: the operator puts the table again, then recovers.
2. **drain** the region's steps that still run (:func:`~isbflow.recovery.job.running_steps`: a fresh
   ``running``/``draining`` heartbeat), upstream first; a step that fails, stops
   or goes silent meanwhile no longer holds the drain up (:func:`drain_steps`).
   Skipped when nothing runs.
3. **recreate**: the *region* is every edge downstream of the sources feeding
   a lost buffer. All its edge streams are deleted and provisioned again from
   the spec (the lost ones are simply created). Surviving ones are recreated
   too: what they hold has source offsets at or above the low offset (else
   every sink would hold it), so the replay regenerates it; keeping them would
   feed those records twice to their readers, and their frames' ids would
   collide with the replay's in JetStream's duplicates window.
4. **rewind**: per source partition the low offset (:mod:`isbflow.isb.ledger`:
   the ledger KV united with the sinks' own ``isb.offsets`` history, dead
   letters counted as done). The region's steps' checkpoints and write stats
   are moved aside (``checkpoints/<pipeline>/_recovered-<stamp>/``; those of the
   newest ``RECOVERED_KEPT`` recoveries are kept, older ones removed), the
   pipeline's checkpoint epoch is bumped (new sink app ids), the sources start
   at their low offsets and every other step at the beginning of its new buffers.
5. **replay**: the region's steps run at once, continuously, as in the normal
   run (each batch flows on while the next is read), and are drained upstream
   first as soon as they have started: the sources stop at the source stream's
   end at that moment. Sinks run in ``merge`` mode: a row is inserted only when
   the table lacks its ``_isb_id`` (a batch of offsets the table's commits never
   recorded is appended as written: the ledger fast path of
   :mod:`isbflow.sinks.delta`). ``pipelined=False`` runs the steps one after
   the other, available-now, instead (measured slower in ``bench/recovery.py``:
   every step's start-up and its whole range in sequence).
6. **verify**: per ``_isb_id`` sink, no duplicate id, and every source
   sequence the source still holds is in the sink or in the dead-letter buffer
   (for a files source: every line of every file landed at the rewind).

Sinks without ``_isb_id`` (aggregates) cannot say which source offsets they
hold, so they do not lower the low offset. In the replay they are merged on
their *dimension* columns (every column not numeric: for a windowed aggregate
the window bounds and group keys): a window the table already holds is kept as
it was, a window it lacks is added (its latest version in the batch). The
replayed stateful step saw only records from the low offset on, so those
windows can be short; the sink may also lack records below the low offset
(no ledger says). So after the replay every aggregate sink fed by a
``udf.output: update`` step is recomputed from the raw sink in batch, all its
windows, in one commit (:func:`isbflow.recovery.aggregates.recompute_sinks`):
it then equals the batch recomputation. The replay phase reports
``recomputed_windows`` per sink; an aggregate without a raw sink to recompute
from stays as replayed (logged, ``recompute_failed``). Recover still reports
these sinks as ``unverified`` (no ids to check).

A buffer lost *during* the replay (its step fails) ends recover with a
:class:`RecoveryError` naming it; running recover again completes the job: it
replays from the ledger's low offset, which every sink commit so far has
moved, and merges on ``_isb_id`` again.

Records lost at the source itself (the source stream missing, or its first
sequence past the low offset) cannot be replayed: they are reported as
``source_lost``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from isbflow.connector.files import ID_PREFIX, landed_lines, landing_folder
from isbflow.isb import ledger, naming, provision
from isbflow.isb import state as st
from isbflow.isb.buffers import recreate_partitions, stream_state
from isbflow.isb.connect import NatsSettings
from isbflow.isb.dlq import read_dead_letters
from isbflow.isb.loss import DetectedLoss, detect_loss, stream_readers
from isbflow.isb.ranges import intersect
from isbflow.isb.routed import read_covered
from isbflow.recovery import pg_sinks
from isbflow.recovery.aggregates import recompute_sinks
from isbflow.recovery.job import (
    SILENT_HEARTBEAT_S,
    Phase,
    RecoveryJob,
    aside_dir,
    dimension_columns,
    missing_references,
    move_aside,
    prune_aside,
    references_refusal,
    region_of,
    running_steps,
)
from isbflow.sinks.delta import count_rows, merge_stats, read_ids, sink_version
from isbflow.spec import Specs
from isbflow.spec.models import Pipeline
from isbflow.spec.paths import DataDir, query_name
from isbflow.steps import drain
from isbflow.steps.runner import (
    HEARTBEAT_S,
    PipelineRunner,
    StepError,
    checkpoint_epoch,
    epoch_file,
)

log = logging.getLogger(__name__)

#: the partitions of a files source's ids (``files/<name>/<line>``)
LANDED_PARTITION = re.compile(rf"^{ID_PREFIX}/[^/]+$")


class RecoveryError(Exception):
    """Recovery could not proceed; the message says which phase, what, and what to do."""


@dataclass
class SinkCheck:
    sink: str
    verified: bool  # False: no _isb_id, cannot be checked by ids
    rows: int = 0
    duplicates: int = 0
    missing: int = 0
    #: rows the replay offered and the table already held (merge dropped them)
    dropped: int = 0
    inserted: int = 0

    @property
    def ok(self) -> bool:
        return not self.verified or (self.duplicates == 0 and self.missing == 0)


@dataclass
class RecoveryReport:
    pipeline: str
    lost: list[DetectedLoss] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    region: list[str] = field(default_factory=list)
    low_offsets: dict[str, dict] = field(default_factory=dict)
    source_lost: dict[str, list[list[int]]] = field(default_factory=dict)
    replayed_records: int = 0
    sinks: list[SinkCheck] = field(default_factory=list)
    seconds: float = 0.0
    state: str = "running"  # running | nothing-lost | recovered | failed
    started_at: float = field(default_factory=time.time)  # epoch seconds
    updated_at: float = field(default_factory=time.time)  # set at each publish (status shows its age)
    pid: int = field(default_factory=os.getpid)  # the process recovering (is it still alive?)
    host: str = field(default_factory=socket.gethostname)

    @property
    def ok(self) -> bool:
        return self.state in ("recovered", "nothing-lost") and all(s.ok for s in self.sinks)

    def to_json(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        for s, obj in zip(d["sinks"], self.sinks, strict=True):
            s["ok"] = obj.ok
        return d


# ------------------------------------------------------------------ drain


async def drain_steps(nc, p: Pipeline, steps: list[str], timeout: float, poll: float = 0.5,
                      silent_after: float | None = None) -> dict[str, str]:
    """Drain ``steps`` (those that run), upstream first; vertex -> how each ended.

    :func:`isbflow.steps.drain.drain_steps` for a pipeline that has just lost a buffer: a step
    that fails, stops, or whose heartbeat stays still for ``silent_after`` seconds (default
    :data:`SILENT_HEARTBEAT_S`; its driver was killed) has ended too (``failed``, ``stopped``, ``gone``) instead of holding the drain
    up until the timeout. Raises :class:`RecoveryError` naming the steps still running after
    ``timeout`` seconds.
    """
    try:
        return await drain.drain_steps(nc, p, steps, timeout=timeout, poll=poll,
                                       silent_after=SILENT_HEARTBEAT_S if silent_after is None else silent_after)
    except drain.DrainTimeout as e:
        raise RecoveryError(f"recover {p.name}: draining timed out after {timeout:.0f}s: step "
                            f"{e.vertex} still runs; stop it, then run recover again") from e


# ------------------------------------------------------------------ helpers


# ------------------------------------------------------------------ recover


def recover(spark, specs: Specs, pipeline: Pipeline, settings: NatsSettings, data_dir: Path, *,
            lost: list[str] | None = None, drain_timeout: float = 300.0,
            on_phase: Callable[[Phase], None] | None = None, pipelined: bool = True,
            replay_timeout: float | None = None) -> RecoveryReport:
    """Recover ``pipeline`` after buffer loss (module docstring); returns the report.

    ``spark`` is a SparkSession or a function making one, called only when
    something was lost. ``lost`` names lost streams explicitly (skips detection). Raises
    :class:`RecoveryError` when a phase cannot proceed (the report so far is in
    the status bucket). ``pipelined``: the replay's steps run at once (module docstring);
    ``replay_timeout``: seconds the pipelined replay may take (default: no limit).
    """
    report = RecoveryReport(pipeline.name)
    with RecoveryJob(settings, pipeline, report, verb="recover", status_key="recovery", on_phase=on_phase,
                     recorded=(RecoveryError,)) as job:
        job.connect()
        r = _Recovery(job, specs, settings, Path(data_dir).absolute())
        if not r.detect(lost):
            report.state = "nothing-lost"
            job.publish()
            return report
        r.spark = spark() if callable(spark) else spark
        r.drain(drain_timeout)
        r.recreate()
        r.rewind()
        r.replay(pipelined, replay_timeout)
        r.verify()
        report.state = "recovered"
        job.publish()
        return report


class _Recovery:
    """The phases of one recover (module docstring), sharing the job, the region and what the
    rewind found (low offsets, the sources' ends, the sinks)."""

    def __init__(self, job: RecoveryJob, specs: Specs, settings: NatsSettings, data_dir: Path):
        self.job, self.specs, self.settings, self.data_dir = job, specs, settings, data_dir
        self.p: Pipeline = job.p
        self.report: RecoveryReport = job.report  # type: ignore[assignment]
        self.spark: Any = None
        self.sources: set[str] = set()
        self.order: list[str] = []
        self.sink_vertices: list[str] = []
        self.id_sinks: list[str] = []
        self.other_sinks: dict[str, list[str]] = {}  # aggregate sink -> its dimension columns
        self.paths: dict[str, str] = {}  # Delta sinks' tables
        self.pg: dict[str, Any] = {}  # PostgreSQL sinks' targets (isbflow.recovery.pg_sinks)
        self.starting: dict[str, dict] = {}
        self.first: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.part_stream: dict[str, str] = {}
        self.landed: dict[str, int] = {}  # a files source's files (files/<name>) -> their lines, at the rewind
        self.lows: dict[str, ledger.LowOffset] = {}
        self.before: dict[str, int | None] = {}

    def detect(self, lost: list[str] | None) -> bool:
        """1. Which buffers are lost (``lost`` when the caller names them); False when none."""
        t, p, job = time.monotonic(), self.p, self.job
        if lost:
            self.report.lost = [DetectedLoss(s, "named by the caller") for s in lost]
        else:
            self.report.lost = job.run(detect_loss(job.nc, p, self.data_dir))
        known = set(stream_readers(p))
        unknown = [b.stream for b in self.report.lost if b.stream not in known]
        if unknown:
            raise RecoveryError(f"recover {p.name}: {', '.join(unknown)} is not a buffer of this pipeline "
                                f"(its buffers: {', '.join(sorted(known))})")
        job.phase("detect", "done", t, lost=[b.stream for b in self.report.lost])
        if not self.report.lost:
            return False
        self.sources, region = region_of(p, {b.stream for b in self.report.lost})
        self.order = [v for v in p.topological_order() if v in region]
        self.report.region = self.order
        missing = job.run(missing_references(job.nc, p, self.order))
        if missing:  # refused before anything changes
            raise RecoveryError(references_refusal("recover", p, missing))
        return True

    def drain(self, timeout: float) -> None:
        """2. Drain the region's steps that still run."""
        t, p, job = time.monotonic(), self.p, self.job
        statuses = job.run(st.all_status(job.nc, p.name, p.topological_order()))
        running = [v for v in running_steps(statuses) if v in self.order]
        if not running:
            job.phase("drain", "skipped", t, reason="no step runs")
            return
        try:
            ended = job.run(drain_steps(job.nc, p, running, timeout=timeout))
        except RecoveryError as e:
            job.phase("drain", "failed", t, running=running, error=str(e))
            raise
        job.phase("drain", "done", t, drained=[v for v, how in ended.items() if how == st.Observed.DRAINED],
                  ended=ended)

    def recreate(self) -> None:
        """3. Delete the region's edge streams and provision them again."""
        t, p, job = time.monotonic(), self.p, self.job
        region_streams = [ep.stream for ep in naming.edge_partitions(p) if ep.from_vertex in self.order]
        deleted, created = job.run(recreate_partitions(
            job.nc, region_streams, provision=lambda: provision.apply(self.settings, self.specs, p.name)))
        for ep in naming.edge_partitions(p):
            if ep.stream in region_streams:
                job.run(st.put_committed(job.nc, p.name, ep.to_vertex, {ep.stream: 0}))
        job.phase("recreate", "done", t, recreated=deleted, created=created)

    def _id_ranges(self, ids) -> ledger.PartitionRanges:
        """Source partition -> ranges of ``ids``: streams' sequences, and files' lines when a files
        source is in the region."""
        out = ledger.id_ranges(ids)
        return {**out, **ledger.id_ranges(ids, partition=LANDED_PARTITION)} if self.landed else out

    def dead_letters(self) -> ledger.PartitionRanges:
        """Source partition -> ranges of its sequences in the dead-letter buffer."""
        out: ledger.PartitionRanges = {}
        for src in sorted(self.sources):
            letters = self.job.run(read_dead_letters(self.settings, self.p.name, src, limit=10_000_000))
            ids = pa.array([d.get("origin") for d in letters], pa.string())
            out = ledger.union(out, self._id_ranges(ids))
        return out

    def rewind(self) -> None:
        """4. Low offsets per source partition; the region's checkpoints and stats moved aside; a
        new checkpoint epoch."""
        t, p, job, data_dir = time.monotonic(), self.p, self.job, self.data_dir
        runner0 = PipelineRunner(self.spark, self.specs, p, self.settings, data_dir)
        try:
            self.sink_vertices = [v for v in self.order if p.vertex(v).sink is not None]
            for v in self.sink_vertices:
                schema = runner0.input_schema(v)
                if p.vertex(v).sink.postgres is not None:
                    self.pg[v] = pg_sinks.target(p, v, data_dir)
                else:
                    self.paths[v] = runner0.sink_path(p.vertex(v))
                if ledger.ID_COLUMN in schema.fieldNames():
                    self.id_sinks.append(v)
                else:
                    self.other_sinks[v] = dimension_columns(schema)
        finally:
            runner0.close()
        kv_ledger = job.run(read_covered(job.nc, p.name))  # offsets routed elsewhere count as held
        held = {v: ledger.union(kv_ledger.get(v, {}), pg_sinks.held(self.pg[v]) if v in self.pg
                                else ledger.from_delta_history(self.paths[v]))
                for v in self.id_sinks}
        dead = self.dead_letters()
        for src in sorted(self.sources):
            files = p.vertex(src).source.files
            if files is not None:  # read again from their folder: the sinks are checked against its files
                self.landed.update(landed_lines(landing_folder(files.path, data_dir), files.pattern))
                continue
            stream = naming.source_stream(p, src)
            part = f"{src}/0"
            sst = job.run(stream_state(job.nc, stream))
            self.part_stream[part] = stream
            self.first[part] = max(1, sst.first_seq) if sst else 1
            self.last[part] = sst.last_seq if sst else 0
        self.lows = ledger.low_offsets(held, list(self.part_stream), dead=dead, first=self.first)
        from_one = ledger.low_offsets(held, list(self.part_stream), dead=dead)
        for part, lo in self.lows.items():
            self.report.low_offsets[part] = lo.to_json()
            src = part.rpartition("/")[0]
            self.starting.setdefault(src, {})[self.part_stream[part]] = {"seq": lo.low - 1}
            if from_one[part].low < self.first[part]:  # sinks lack records the source no longer holds
                self.report.source_lost[part] = [[from_one[part].low, self.first[part] - 1]]
        stamp = time.strftime("%Y%m%dT%H%M%S")
        dirs = DataDir(data_dir)
        ck, stats = dirs.checkpoints(p.name), dirs.stats_of(p.name)
        ck_aside, stats_aside = aside_dir(ck, stamp), aside_dir(stats, stamp)
        moved = []
        for v in self.order:
            names = [query_name(v, None), *[query_name(v, e.to) for e in p.outputs(v)]]
            moved += move_aside([ck / n for n in names], ck_aside)
            moved += move_aside([stats / n for n in names], stats_aside)
        pruned = prune_aside(ck) + prune_aside(stats)  # the newest RECOVERED_KEPT recoveries' copies stay
        epoch = checkpoint_epoch(data_dir, p.name) + 1
        ef = epoch_file(data_dir, p.name)
        ef.parent.mkdir(parents=True, exist_ok=True)
        ef.write_text(str(epoch))
        self.before = {v: pg_sinks.clock(self.pg[v]) if v in self.pg else sink_version(self.paths[v])
                       for v in self.sink_vertices}
        job.phase("rewind", "done", t, low_offsets=self.report.low_offsets, moved_aside=moved, pruned=pruned,
                  epoch=epoch, id_sinks=self.id_sinks, merged_by_dimensions=self.other_sinks)

    def replay(self, pipelined: bool, timeout: float | None) -> None:
        """5. The region's steps from the low offsets, sinks in merge mode; aggregates recomputed."""
        t, p, job = time.monotonic(), self.p, self.job
        runner = PipelineRunner(self.spark, self.specs, p, self.settings, self.data_dir, starting_offsets=self.starting,
                                sink_mode="merge", merge_keys=self.other_sinks, replay=True)
        try:
            if pipelined:
                out = _replay_pipelined(runner, job.nc, p, self.order, job.run, timeout)
            else:
                out = runner.run_available_now(only=self.order)
            recomputed, recompute_failed = recompute_sinks(self.spark, runner, self.sink_vertices, self.data_dir)
        except StepError as e:
            lost_now = job.run(detect_loss(job.nc, p, self.data_dir))
            if not lost_now:
                raise
            names = ", ".join(b.stream for b in lost_now)
            job.phase("replay", "failed", t, steps=self.order, error=str(e).splitlines()[0][:500],
                      lost=[asdict(b) for b in lost_now])
            raise RecoveryError(f"recover {p.name}: buffer(s) {names} lost during the replay ({e}); run "
                                "recover again: it replays from the ledger's low offset, which the sinks' "
                                "commits so far have moved") from e
        finally:
            runner.close()
        # the sources' records from their low offsets on (the runner's rows_total of an available-now
        # run counts its last micro-batch only); a files source counts what its step read
        self.report.replayed_records = sum(max(0, self.last[part] - lo.low + 1) for part, lo in self.lows.items()) + sum(
            out[s].rows_total for s in self.sources if s in out and p.vertex(s).source.jetstream is None)
        job.phase("replay", "done", t, steps=self.order, replayed_records=self.report.replayed_records,
                  recomputed_windows=recomputed, **({"recompute_failed": recompute_failed}
                                                    if recompute_failed else {}))

    def verify(self) -> None:
        """6. Per ``_isb_id`` sink: no duplicate, every sequence the source holds present or dead-lettered
        (but for a sink fed through ``conditions.tags``, which holds the records routed to it)."""
        t = time.monotonic()
        dead = self.dead_letters()  # the replay dead-letters again what a lost dead-letter buffer held
        for v in self.sink_vertices:
            pg = self.pg.get(v)
            offered, inserted = (pg_sinks.merge_stats(pg, self.before[v]) if pg
                                 else merge_stats(self.paths[v], self.before[v]))
            if v not in self.id_sinks:
                rows = pg_sinks.count_rows(pg) if pg else count_rows(self.paths[v])
                self.report.sinks.append(SinkCheck(v, False, rows=rows, dropped=offered - inserted,
                                                   inserted=inserted))
                continue
            ids = pg_sinks.ids(pg) if pg else read_ids(self.paths[v])[0]
            check = SinkCheck(v, True, rows=len(ids), duplicates=len(ids) - pc.count_distinct(ids).as_py(),
                              dropped=offered - inserted, inserted=inserted)
            present = self._id_ranges(ids) if len(ids) else {}
            # a sink fed through conditions.tags holds a subset: only duplicates can be judged by ids
            wants = {**{part: (self.first[part], self.last[part]) for part in self.part_stream},
                     **{part: (1, lines) for part, lines in self.landed.items()}}
            for part, (first, last) in [] if self.p.filtered(v) else wants.items():
                covered = ledger.normalize([*present.get(part, []), *dead.get(part, [])])
                want = [[first, last]] if last >= first else []
                check.missing += ledger.count(want) - ledger.count(intersect(covered, want))
            self.report.sinks.append(check)
        self.job.phase("verify", "done" if all(s.ok for s in self.report.sinks) else "failed", t,
                       sinks=[asdict(s) for s in self.report.sinks])


def _replay_pipelined(runner, nc, p: Pipeline, order: list[str], run: Callable, timeout: float | None) -> dict:
    """The region's steps continuously in a thread of this process, drained (upstream first) as
    soon as every query has started; returns each step's status. A step failing raises its
    :class:`~isbflow.steps.runner.StepError` here, as the available-now run would."""
    result: dict[str, Any] = {}

    def go() -> None:
        try:
            # the replay beats as often as it always did: its drains are noticed on a beat
            result["out"] = runner.run_continuous(only=order, poll=0.2, heartbeat_every=HEARTBEAT_S)
        except BaseException as e:  # noqa: BLE001 - raised again below, in the caller's thread
            result["error"] = e

    def started() -> bool:
        return all(v in runner.runs for v in order) and all(
            rq.query is not None for v in order for rq in runner.runs[v].queries)

    thread = threading.Thread(target=go, name=f"isbflow-replay-{p.name}", daemon=True)
    thread.start()
    try:
        while thread.is_alive() and not started():
            time.sleep(0.1)
        if thread.is_alive():
            # The runner has set every step's desired state to running before starting them;
            # only now may the drain set it to draining (the sources stop at the streams' ends
            # now). The steps run in this process: a heartbeat held up by a query restart (its
            # backoff and start-up can pass SILENT_HEARTBEAT_S on a loaded machine) is no killed
            # driver, so "gone" waits much longer here.
            run(drain_steps(nc, p, order, timeout=timeout or 365 * 86400.0, poll=0.2,
                            silent_after=SILENT_HEARTBEAT_S * 20))
        thread.join()
    except BaseException:
        runner.stop_all()
        thread.join(60)
        raise
    if "error" in result:
        raise result["error"]
    out = result.get("out") or {}
    failed = [v for v, s in out.items() if s.state != st.Observed.DRAINED]
    if failed:
        raise RecoveryError(f"recover {p.name}: the replay's step(s) {', '.join(failed)} ended "
                            f"{', '.join(str(out[v].state) for v in failed)} instead of drained")
    return out
