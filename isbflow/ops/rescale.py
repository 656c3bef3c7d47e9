"""The rescale verb: change how many partitions the buffers into a vertex have, losing and doubling nothing.

Called by ``isbflow pipeline rescale`` and the ``pipeline_rescale`` DAG's operator. The spec
is the one source of the partition count: the file must already say ``partitions: N`` on the
vertex (so ``isbflow isb diff -f SPEC`` shows no drift afterwards, and a later ``start`` or
``isb apply`` keeps what the rescale made); :func:`rescale` makes the live pipeline agree
with it, in this order:

1. **check**, changing nothing: the spec says ``partitions: N``; the vertex reads buffers
   (a source has none); its query keeps no state (:func:`state_held`: an aggregation's state
   lives in its checkpoint, in as many state partitions as the vertex had at its first batch,
   and Spark cannot move it to another number); its checkpoint does not still name a stream
   about to be created (a partition removed and added again before the step ran a batch:
   its reader would take the new stream for the old one recreated, a buffer loss);
2. **drain** the pipeline when its driver runs here (:func:`isbflow.ops.pipeline.drain_and_wait`,
   upstream first, final offsets committed) and wait for the driver to exit; a pipeline whose
   steps heartbeat from a driver this host has no launch of is refused (it cannot be drained
   and started again from here);
3. **check what is unread**: every partition the server holds for the vertex's in edges must
   be fully read by the vertex (:func:`isbflow.isb.provision_partitions.held_partitions`).
   An unread message in a partition about to be removed would be lost; one in a partition
   that stays would be read beside records of the same key routed by the new count, out of
   order. Either is refused (:class:`RescaleRefused` names each stream and its unread count)
   unless ``force``: then removed partitions drop theirs (counted in :attr:`Rescaled.dropped`);
4. **re-partition**: create the partitions the spec adds (provisioning, all or nothing) and
   remove those it no longer has (with their committed sequences);
5. **resume**: start the pipeline again when it ran before, and wait until every step runs.

The resumed query of the vertex reads its new set of streams. Its checkpoint's offsets (per
stream: incarnation and last sequence, :mod:`isbflow.connector.offsets`) hold the streams it
read before; a stream they do not name is read from its beginning (the reader's rule for a
partition added since the checkpoint), a stream they name and the spec no longer has is not
read again. Writers route ``partitionKey`` records by ``pmod(xxhash64(key), N)`` with the new
``N`` from the first batch after the resume: every key again goes to one partition, and since
the old partitions were read to their end first, the records of a key stay in order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isbflow.isb.connect import IsbUnreachable, NatsSettings, session
from isbflow.isb.loss import checkpoint_offsets
from isbflow.isb.naming import EdgePartition
from isbflow.isb.provision_partitions import HeldPartition, held_partitions, remove_partitions
from isbflow.isb.state import Observed
from isbflow.ops.isb import grant
from isbflow.ops.pipeline import (
    REFERENCE_DIR,
    DrainTimeout,
    LaunchError,
    PipelineError,
    drain_and_wait,
    live_launch,
    provision_buffers,
    start,
    status,
    wait_state,
)
from isbflow.spec import Specs
from isbflow.spec.models import OutputMode, Pipeline
from isbflow.spec.paths import DataDir
from isbflow.steps.checkpoints import newest_commit

__all__ = ["DrainTimeout", "IsbUnreachable", "RescaleError", "RescaleRefused", "Rescaled", "rescale",
           "state_held"]

Progress = Callable[[str], None]


def _quiet(_m: str) -> None:
    pass


class RescaleError(Exception):
    """A rescale failed in a way retrying cannot fix; the message names what and where."""


class RescaleRefused(RescaleError):
    """A rescale was refused; the message says why and what to do. ``drained``: the pipeline was
    drained before the refusal and stays stopped."""

    def __init__(self, message: str, drained: bool = False):
        super().__init__(message)
        self.drained = drained


@dataclass
class Rescaled:
    """What :func:`rescale` did."""

    pipeline: str
    vertex: str
    #: partitions the server held before (per in edge, the most), and the spec's number
    before: int
    after: int
    #: True: the pipeline ran and was drained first
    drained: bool = False
    created: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    #: stream -> unread messages dropped with it (``force`` only)
    dropped: dict[str, int] = field(default_factory=dict)
    #: stream -> its last sequence when the partitions changed (what the old count wrote into it)
    cut: dict[str, int] = field(default_factory=dict)
    #: the driver started again (None: the pipeline did not run, and still does not)
    launch_id: str | None = None
    seconds: float = 0.0

    @property
    def changed(self) -> bool:
        return bool(self.created or self.removed)

    def to_json(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "vertex": self.vertex, "before": self.before, "after": self.after,
                "changed": self.changed, "drained": self.drained, "created": self.created,
                "removed": self.removed, "dropped": self.dropped, "cut": self.cut, "launch": self.launch_id,
                "seconds": round(self.seconds, 3)}


def check_spec(spec_file: Path, p: Pipeline, vertex: str, partitions: int | None) -> int:
    """The partition count the spec gives ``vertex``; :class:`RescaleRefused` when it has no such
    vertex, the vertex reads no buffer, or ``partitions`` (what the user asked for) differs."""
    names = [v.name for v in p.spec.vertices]
    if vertex not in names:
        raise RescaleRefused(f"{spec_file}: pipeline {p.name} has no vertex {vertex!r} "
                             f"(vertices: {', '.join(names)})")
    v = p.vertex(vertex)
    if not p.inputs(vertex):
        raise RescaleRefused(f"{spec_file}: vertex {vertex!r} reads no buffer ({v.role}): its partitions are "
                             "those of the buffers into it; rescale a vertex it feeds")
    if partitions is not None and partitions != v.partitions:
        raise RescaleRefused(
            f"{spec_file}: vertices[{names.index(vertex)}].partitions of {vertex!r} is {v.partitions}, not "
            f"{partitions}: the spec is what start and 'isb apply' provision, so a rescale applies what it says; "
            f"set 'partitions: {partitions}' on vertex {vertex} in {spec_file}, then rescale")
    return v.partitions


def state_held(data_dir: Path, p: Pipeline, vertex: str) -> str | None:
    """Why ``vertex``'s state cannot move to another partition count, or None when it keeps none.

    Spark keeps a stateful query's state (an aggregation's groups and windows, a deduplication's
    keys) in its checkpoint, split into the shuffle partitions it recorded at its first batch (the
    vertex's partitions then, :func:`isbflow.steps.session.step_query_conf`), and cannot split it
    again. A vertex whose checkpoint holds state, or a declared aggregation (``output: update``)
    that has committed a batch, keeps that number whatever the spec says."""
    ckpt = DataDir(data_dir).checkpoint(p.name, vertex, p.query_to(vertex))
    state = ckpt / "state"
    has_state = state.is_dir() and any(state.iterdir())
    v = p.vertex(vertex)
    declared = v.udf is not None and v.udf.output == OutputMode.UPDATE
    if not has_state and not (declared and newest_commit(ckpt) is not None):
        return None
    what = f"an aggregation (output: update, keys {v.udf.keys})" if declared and v.udf else "a stateful query"
    return (f"step {vertex!r} is {what} whose state lives in its checkpoint {ckpt}, split into the partitions it "
            "had at its first batch; Spark cannot move a query's state to another number of partitions, so "
            "the step would keep its old number whatever the spec says. Keep its partitions, or drain the "
            "pipeline and start the step afresh from its sinks' offset ledger ('isbflow replay --mode "
            "recover', which recomputes its windows from the raw sink)")


def _names_to_create(data_dir: Path, p: Pipeline, vertex: str, held: list[HeldPartition], n: int) -> list[str]:
    """The streams of ``n`` partitions the server does not hold yet; :class:`RescaleRefused` when the
    vertex's checkpoint still names one of them."""
    have = {h.stream for h in held}
    new = [EdgePartition(p.name, e.from_, vertex, i).stream for e in p.inputs(vertex) for i in range(n)]
    new = [s for s in new if s not in have]
    ckpt = DataDir(data_dir).checkpoint(p.name, vertex, p.query_to(vertex))
    named = [s for s in new if s in checkpoint_offsets(ckpt)]
    if named:
        raise RescaleRefused(
            f"the checkpoint {ckpt} of step {vertex!r} still names {', '.join(named)}, removed by an earlier "
            "rescale before the step ran a batch: created again, its reader would take the new stream for the "
            "old one recreated (buffer loss). Start the pipeline once with the partitions the server holds "
            "(the step moves past them at its next batch), then rescale")
    return new


def _unread_refusal(held: list[HeldPartition], n: int) -> str:
    lines = []
    for h in held:
        if h.unread:
            fate = ("removed by the rescale: they would be lost" if h.partition >= n else
                    "kept: they would be read beside records routed by the new count, out of key order")
            lines.append(f"  {h.stream} (buffer {h.edge}, partition {h.partition}): {h.unread} unread message(s), "
                         f"{fate}")
    return "\n".join(lines)


def _held(settings: NatsSettings, p: Pipeline, vertex: str) -> list[HeldPartition]:
    async def go() -> list[HeldPartition]:
        async with session(settings, name="isbflow-rescale") as nc:
            return await held_partitions(nc, p, vertex)

    return asyncio.run(go())


def _remove(settings: NatsSettings, p: Pipeline, vertex: str, streams: list[str]) -> list[str]:
    async def go() -> list[str]:
        async with session(settings, name="isbflow-rescale") as nc:
            return await remove_partitions(nc, p, vertex, streams)

    return asyncio.run(go())


#: a step whose heartbeat is younger than this, in a live state, runs
LIVE_HEARTBEAT_S = 60.0


def _live_elsewhere(settings: NatsSettings, p: Pipeline) -> str:
    """The steps of ``p`` that report a live state with a fresh heartbeat ("" when none): a driver
    this host has no launch record of (``isbflow pipeline run`` in a terminal, another host)."""
    st = status(settings, p)
    live = [f"step {v} {s.state}, heartbeat {s.age():.0f}s ago" for v, s in st.statuses.items()
            if s is not None and s.state in (Observed.STARTING, Observed.RUNNING, Observed.DRAINING)
            and s.age() < LIVE_HEARTBEAT_S]
    return "; ".join(live)


def _count(held: list[HeldPartition]) -> int:
    per_edge: dict[str, int] = {}
    for h in held:
        per_edge[h.edge] = per_edge.get(h.edge, 0) + 1
    return max(per_edge.values(), default=0)


def rescale(spec_file: Path, specs: Specs, p: Pipeline, vertex: str, settings: NatsSettings, data_dir: Path, *,
            partitions: int | None = None, force: bool = False, drain_timeout: float = 300.0,
            exit_timeout: float = 120.0, wait_timeout: float = 240.0, master: str | None = None,
            workdir: Path | None = None, references_dir: Path | None = None,
            env: Mapping[str, str] | None = None, progress: Progress = _quiet) -> Rescaled:
    """Give the buffers into ``vertex`` the partition count ``p``'s spec says (module docstring).

    ``partitions``: the count the caller asks for, which the spec must say. ``master`` (default:
    the previous launch's) and ``workdir`` are the resumed driver's; ``references_dir`` where its
    reference tables are (default ``<spec dir>/reference``). Idempotent: when the server already
    holds the spec's partitions, nothing is drained or changed. Raises :class:`RescaleRefused`
    (nothing changed, unless ``drained``), :class:`DrainTimeout`, :class:`RescaleError`, and
    :class:`IsbUnreachable`.
    """
    began = time.monotonic()
    n = check_spec(spec_file, p, vertex, partitions)
    held = _held(settings, p, vertex)
    out = Rescaled(p.name, vertex, _count(held), n)
    want = {(e.from_, i) for e in p.inputs(vertex) for i in range(n)}
    if {(h.from_vertex, h.partition) for h in held} == want:
        progress(f"the buffers into {vertex} already have {n} partition(s): nothing to do")
        out.seconds = time.monotonic() - began
        return out
    if why := state_held(data_dir, p, vertex):
        raise RescaleRefused(f"refused, nothing was changed: {why}")
    _names_to_create(data_dir, p, vertex, held, n)

    launch = live_launch(data_dir, p)
    running = launch is not None and launch.alive() is True
    if running:
        progress(f"draining pipeline {p.name} (upstream first)")
        drained = drain_and_wait(settings, p, data_dir, timeout=drain_timeout, exit_timeout=exit_timeout)
        if drained.driver_exited is False:
            raise RescaleError(f"pipeline {p.name} drained but its driver (pid {launch.pid}) still runs "
                               f"{exit_timeout:.0f}s later; see {launch.log}. Nothing was re-partitioned")
        out.drained = True
        held = _held(settings, p, vertex)
    elif live := _live_elsewhere(settings, p):
        raise RescaleRefused(f"refused, nothing was changed: pipeline {p.name} runs without a launch on this host "
                             f"({live}): a rescale drains and starts only a driver launched here. Drain it "
                             f"('isbflow pipeline drain -f {spec_file}'), rescale, then start it")
    unread = [h for h in held if h.unread]
    if unread and not force:
        stays = (f"; pipeline {p.name} was drained and stays stopped until you rescale again or start it"
                 if out.drained else "")
        raise RescaleRefused(f"refused, nothing was re-partitioned: the buffers into {vertex} are not fully "
                             f"read{stays}:\n{_unread_refusal(held, n)}\n  -> start the pipeline and let "
                             f"{vertex} read them (then rescale), or pass --force (unread messages in removed "
                             "partitions are lost)", drained=out.drained)

    progress(f"re-partitioning the buffers into {vertex}: {out.before} -> {n}")
    out.cut = {h.stream: h.last_seq for h in held}
    out.created = _names_to_create(data_dir, p, vertex, held, n)
    try:
        provision_buffers(settings, specs, p, data_dir=data_dir)  # Redis: its ACL user takes the new partitions
    except PipelineError as e:
        raise RescaleError(f"{e}; nothing was removed") from None
    grant(p, data_dir)
    gone = [h for h in held if h.partition >= n]
    out.dropped = {h.stream: h.unread for h in gone if h.unread}
    out.removed = _remove(settings, p, vertex, [h.stream for h in gone])

    if running:
        assert launch is not None
        progress(f"starting pipeline {p.name} again")
        refs = references_dir if references_dir is not None else Path(spec_file).parent / REFERENCE_DIR
        try:
            started = start(spec_file, specs, p, settings, data_dir, master=master or launch.master,
                            workdir=workdir, references_dir=refs, provision=False, env=env, progress=progress)
        except (PipelineError, LaunchError) as e:
            raise RescaleError(f"pipeline {p.name} was re-partitioned ({out.before} -> {n}) but did not start "
                               f"again: {e}; start it with the spec as it is") from None
        out.launch_id = started.launch.launch_id
        check = wait_state(settings, p, data_dir, "running", timeout=wait_timeout, progress=progress)
        if not check.done:
            steps = ", ".join(f"{v} {s}" for v, s in check.steps.items())
            raise RescaleError(f"pipeline {p.name} was re-partitioned but did not run again: "
                               f"{check.problem or f'not every step runs after {wait_timeout:.0f}s'} ({steps}); "
                               f"driver log {started.launch.log}")
    out.seconds = time.monotonic() - began
    return out
