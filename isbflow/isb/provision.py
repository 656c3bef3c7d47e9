"""Provisioning: make the ISB service hold exactly the buffers a pipeline's spec asks for.

For one pipeline (see :func:`desired_resources`) isbflow owns:

- one stream per edge partition (:func:`isbflow.isb.naming.edge_partitions`);
- the stream of each external JetStream source (subjects = the source's subject);
- the dead-letter stream, subjects ``isb.<pipeline>.dlq.>``;
- the KV buckets ``control``, ``status`` and ``ledger``.

Streams take their configuration from the pipeline's ISB service
``bufferConfig.stream``: ``retention`` -> retention, ``maxMsgs`` -> max_msgs,
``maxAge`` -> max_age, ``maxBytes`` -> max_bytes, ``storage`` -> storage,
``replicas`` -> num_replicas, ``duplicates`` -> duplicate_window, and
``settings.max_payload`` -> max_msg_size; ``allow_direct`` is always on (readers
use batched direct gets). Report fields use these JetStream names. The
dead-letter stream takes the same fields from ``bufferConfig.deadLetter`` alone
(its own defaults: file, Limits, 100,000 messages, 256MiB, 7 days; replicas those
of ``bufferConfig.stream`` unless set), and refuses new letters when full
(discard ``new`` whenever it is bounded): a letter never vanishes to make room.

Discard policy: with ``Limits`` retention the limits *are* the retention rule, so
the oldest messages go (``discard: old``); the reader notices a first sequence
that moved past an uncommitted offset as buffer loss. With ``WorkQueue`` or
``Interest`` retention and a ``maxMsgs`` or ``maxBytes`` set, the limit is a
capacity: a full buffer refuses new messages (``discard: new``), so producers
see back-pressure instead of unread messages being dropped.

KV buckets are file-backed when the service has ``persistence`` (memory
otherwise), with ``bufferConfig.stream.replicas`` replicas: the ledger must
outlive the buffers it describes. History: control 5 (an audit trail of desired
states), status 1, ledger 5.

A source whose spec names its ``stream:`` points at a stream its producers
own: isbflow creates it when missing and otherwise leaves it alone.

Every resource carries metadata ``isbflow.pipeline``, ``isbflow.role``, for edges
``isbflow.edge`` and ``isbflow.partition``, for sources ``isbflow.vertex``, and
``isbflow.spec-hash``: a hash of the managed fields as provisioned, so drift is
detectable from the server alone. The labels name the resource's **owner**: a stream
whose metadata names another owner (another pipeline, edge or partition that derives
the same name) is never updated, recreated or deleted, whatever the flags (``apply``
and ``delete`` refuse the whole run; ``diff`` shows field ``owner``, class ``foreign``);
a stream without owner metadata (from an older isbflow) is adopted. Validation refuses
specs loaded together whose derived names collide (:mod:`isbflow.spec.derived`); the
metadata guards specs that were never loaded together.

Contract of :func:`apply` (idempotent; a second run reports every resource
``unchanged``), in two phases:

1. **plan**, changing nothing: every resource is read from the server and every
   differing field classified (:mod:`isbflow.isb.provision_plan`): *in place, safe*;
   *may discard unread messages*; *needs a recreate* (storage, retention).
   A source naming a stream, or a subject that falls on a stream, whose metadata names another
   pipeline is refused first (:mod:`isbflow.isb.owners`), naming the owner.
2. **all or nothing**: when any change is refused, nothing at all is applied, every
   buffer stays as it was, and :class:`ProvisionRefused` names each refused stream,
   field, old -> new and unread count. Refused: a recreate without ``recreate=True``;
   a recreate of a stream holding messages, or a change that may discard unread
   messages, without ``force=True``. Otherwise it creates what is missing, updates
   in place, and deletes and creates again what needs a recreate.

The ISB service itself is checked first: it must have at least ``jetstream.replicas``
servers (when the spec sets it) and as many as the largest replica count asked for;
given the data dir, an embedded server recorded there must run with the store limits
the spec sets (``settings.max_memory_store``/``max_file_store`` apply when isbflow
starts that server, so a difference needs a restart, never a silent pass).
Server refusals while applying raise :class:`ProvisionError` naming the resource and
what to do (a change the server refuses midway cannot be rolled back).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nats.errors import Error as NatsError
from nats.js.api import KeyValueConfig, RetentionPolicy, StorageType, StreamConfig, StreamInfo
from nats.js.errors import NotFoundError

from isbflow.isb import owners
from isbflow.isb.connect import NatsSettings, session
from isbflow.isb.provision_partitions import extra_partitions
from isbflow.isb.provision_plan import (
    Holding,
    ResourcePlan,
    compare,
    foreign_owner,
    holding,
    needs_age,
    owner_text,
    refusal_message,
)
from isbflow.isb.provision_report import (
    Action,
    ChangeClass,
    Drift,
    FieldChange,
    ProvisionReport,
    ReplicaHealth,
    ResourceResult,
    StreamStatus,
)
from isbflow.isb.provision_resources import (
    HASH_KEY,
    IMMUTABLE_FIELDS,
    KV_HISTORY,
    META_PREFIX,
    Kind,
    Resource,
    desired_resources,
    discard_policy,
    select_pipeline,
    spec_hash,
)
from isbflow.isb.provision_server import (
    cipher_drift,
    drop,
    embedded_limits,
    embedded_state,
    recreated_message,
    restart,
    servers_reporting,
    store_drift,
    toggle_refusal,
)
from isbflow.isb.release import interest_hold_consumer
from isbflow.spec import derived
from isbflow.spec.load import Specs
from isbflow.spec.models import Pipeline

if TYPE_CHECKING:
    import nats.aio.client
    from nats.js import JetStreamContext

__all__ = ["HASH_KEY", "IMMUTABLE_FIELDS", "KV_HISTORY", "META_PREFIX", "Action", "ChangeClass", "Drift",
           "FieldChange", "Kind", "ProvisionError", "ProvisionRefused", "ProvisionReport", "ReplicaHealth",
           "Resource", "ResourceResult", "StreamStatus", "apply", "delete", "desired_resources", "diff",
           "discard_policy", "plan", "select_pipeline", "spec_hash", "status"]


class ProvisionError(Exception):
    """The ISB service refused a change; the message names the resource and what to do.

    ``report`` holds what was done before the refusal.
    """

    def __init__(self, message: str, report: ProvisionReport | None = None):
        super().__init__(message)
        self.report = report


class ProvisionRefused(ProvisionError):
    """A change was refused before anything was applied (the server is as it was).

    ``report`` lists every resource: ``refused`` ones with their classified changes,
    ``skipped`` ones that would have changed; the message has one line per refused change.
    """


# ------------------------------------------------------------------ server side


@asynccontextmanager
async def _jetstream(settings: NatsSettings) -> AsyncIterator[tuple[nats.aio.client.Client, JetStreamContext]]:
    async with session(settings, name="isbflow-provision") as nc:
        # creating an R3 stream forms a raft group: allow for a busy small machine
        yield nc, nc.jetstream(timeout=30.0)


async def _info(js: JetStreamContext, stream: str) -> StreamInfo | None:
    try:
        return await js.stream_info(stream)
    except NotFoundError:
        return None


def _server_error(verb: str, r: Resource, settings: NatsSettings, e: Exception) -> ProvisionError:
    desc = getattr(e, "description", None) or str(e) or type(e).__name__
    what = f"{verb} {'KV bucket' if r.kind == 'kv' else 'stream'} {r.name} on the ISB service at {settings.display}"
    hint = ""
    replicas = r.fields.get("num_replicas", 1)
    if replicas > 1 and ("replicas" in desc.lower() or "insufficient resources" in desc.lower()):
        hint = _replicas_hint(replicas)
    elif "insufficient storage" in desc.lower() and r.fields.get("max_bytes", -1) > 0:
        where = "deadLetter" if r.labels.get("isbflow.role") == "dlq" else "stream"
        hint = (f": JetStream reserves max_bytes ({r.fields['max_bytes']} bytes, bufferConfig.{where}.maxBytes) "
                "for every stream up front; lower maxBytes, or give the server more "
                f"{'memory' if r.fields['storage'] == StorageType.MEMORY else 'file'} store "
                "(jetstream max_file_store / max_memory_store)")
    return ProvisionError(f"{what} failed: {desc}{hint}")


def _replicas_hint(replicas: int) -> str:
    return (f": bufferConfig.stream.replicas is {replicas}, so the service needs a JetStream cluster "
            f"of at least {replicas} servers (e.g. 'isbflow nats up --cluster {replicas}'); "
            "or lower bufferConfig.stream.replicas")


async def _check_service(nc: nats.aio.client.Client, specs: Specs, pipeline: str, resources: list[Resource],
                         settings: NatsSettings, limits: dict[str, int] | None = None) -> None:
    """Before anything is applied: the service has the servers and the store limits the spec asks for."""
    for f, want, have in store_drift(specs, pipeline, limits):
        raise ProvisionError(
            f"settings.{f} is {want} bytes but the embedded nats-server at {settings.display} runs with {have}: "
            "the store limits apply when isbflow starts the server; stop it ('isbflow nats down') and start it "
            f"from the spec ('isbflow platform up --pipeline-file SPEC'), or set settings.{f} to {have}")
    jet = specs.service_for(specs.select(pipeline)).spec.jetstream
    want = max((r.fields.get("num_replicas", 1) for r in resources), default=1)
    servers = await servers_reporting(nc, max(want, jet.replicas or 1))
    if servers is None:
        return
    where = f"the ISB service at {settings.display} has {servers} JetStream server(s)"
    if jet.replicas is not None and jet.replicas > servers:
        raise ProvisionError(
            f"{where}, the spec asks for {jet.replicas} (jetstream.replicas): isbflow does not start servers "
            f"for a running service; start {jet.replicas} (e.g. 'isbflow nats up --cluster {jet.replicas}'), "
            "or lower jetstream.replicas")
    if want > servers:
        first = next(r for r in resources if r.fields.get("num_replicas", 1) == want)
        raise ProvisionError(f"{where}: stream {first.name} and the others need {want} replicas{_replicas_hint(want)}")


async def _owned_elsewhere(nc: nats.aio.client.Client, js: JetStreamContext, p: Pipeline) -> list[str]:
    """The streams and subjects ``p``'s sources name that a stream of another pipeline holds (its
    metadata names that pipeline: :mod:`isbflow.isb.owners`), one line each naming the owner."""
    mine = [c for c in derived.claims(p) if c.identity[0] in ("named-stream", "source-subject")]
    found: dict[str, StreamInfo] = {}
    for c in mine:
        if c.kind == "stream":
            names = [c.name]
        else:  # the streams whose subjects take this one
            reply = await nc.request("$JS.API.STREAM.NAMES", json.dumps({"subject": c.name}).encode(),
                                         timeout=10)
            names = json.loads(reply.data).get("streams") or []
        for n in names:
            if n not in found and (info := await _info(js, n)) is not None:
                found[n] = info
    held = owners.server_claims((i.config.name, i.config.subjects or [], i.config.metadata) for i in found.values())
    return owners.foreign(mine, held)


async def _ensure_hold(js: JetStreamContext, r: Resource) -> None:
    """Interest streams keep nothing without a consumer (checked on nats-server 2.15.1:
    5 published, 0 stored): give each one the durable hold consumer, so messages stay
    until :func:`isbflow.isb.release.release` purges them after the downstream
    commit. Creating a durable with the same config again is a no-op."""
    if r.kind == "stream" and r.fields.get("retention") == RetentionPolicy.INTEREST:
        await js.add_consumer(r.stream, interest_hold_consumer())


async def _create(js: JetStreamContext, r: Resource) -> None:
    if r.kind == "stream":
        await js.add_stream(StreamConfig(name=r.name, metadata=r.metadata(), **r.fields))
        await _ensure_hold(js, r)
        return
    f = r.fields
    await js.create_key_value(KeyValueConfig(
        bucket=r.name, description=f["description"], history=f["max_msgs_per_subject"],
        storage=f["storage"], replicas=f["num_replicas"], direct=f["allow_direct"],
    ))
    # KeyValueConfig has no metadata: label the bucket's stream in a second step.
    info = await js.stream_info(r.stream)
    await js.update_stream(_updated(info.config, {}, r.metadata()))


def _updated(config: StreamConfig, changes: dict[str, Any], metadata: dict[str, str]) -> StreamConfig:
    """The server's config with ``changes`` and our metadata; foreign metadata kept, server-set keys dropped."""
    kept = {k: v for k, v in (config.metadata or {}).items()
            if not k.startswith(META_PREFIX) and not k.startswith("_nats.")}
    return config.evolve(**changes, metadata={**kept, **metadata})


async def _plan_one(js: JetStreamContext, r: Resource) -> ResourcePlan:
    info = await _info(js, r.stream)
    if info is None or not r.managed:
        held = Holding(info.state.messages, info.state.bytes, info.state.messages) if info else Holding()
        return ResourcePlan(r, info, holding=held)
    owner = foreign_owner(r, info.config.metadata)
    if owner:  # someone else's stream: nothing of it is ours to compare or change
        held = Holding(info.state.messages, info.state.bytes, info.state.messages)
        change = FieldChange("owner", owner, owner_text(r.labels), ChangeClass.FOREIGN,
                             "the stream's metadata names another owner: never updated, recreated or deleted")
        return ResourcePlan(r, info, [change], None, held, owner=owner)
    held = await holding(js, r, info, needs_age(r, info.config))
    changes, meta = compare(r, info.config, held)
    return ResourcePlan(r, info, changes, meta, held)


async def _plan(js: JetStreamContext, resources: list[Resource]) -> list[ResourcePlan]:
    return [await _plan_one(js, r) for r in resources]


async def _execute(js: JetStreamContext, p: ResourcePlan, settings: NatsSettings) -> ResourceResult:
    r, action = p.resource, p.action
    verb = {Action.CREATED: "creating", Action.RECREATED: "recreating"}.get(action, "updating")
    try:
        if action == Action.CREATED:
            await _create(js, r)
        elif action == Action.RECREATED:
            await js.delete_stream(r.stream)
            await _create(js, r)
        elif r.managed:
            await _ensure_hold(js, r)
            if action == Action.UPDATED:
                assert p.info is not None
                await js.update_stream(_updated(p.info.config, {c.field: c.new for c in p.changes}, r.metadata()))
    except NatsError as e:
        raise _server_error(verb, r, settings, e) from None
    message = ""
    if action == Action.RECREATED and p.holding.messages:
        message = f"dropped {p.holding.messages} message(s), {p.holding.unread} unread"
    elif not r.managed and p.exists:
        message = "named in the spec: not managed"
    elif any(c.cls == ChangeClass.MAY_DISCARD for c in p.changes):
        message = "forced: " + "; ".join(c.reason for c in p.changes if c.cls == ChangeClass.MAY_DISCARD)
    return p.result(applied=action != Action.UNCHANGED, message=message)


# ------------------------------------------------------------------ public API


async def plan(settings: NatsSettings, specs: Specs, pipeline: str | None = None, *,
               recreate: bool = False, force: bool = False) -> list[ResourcePlan]:
    """What :func:`apply` would do to each resource, every change classified; changes nothing."""
    p = select_pipeline(specs, pipeline)
    resources = desired_resources(specs, p.name)
    async with _jetstream(settings) as (_, js):
        plans = await _plan(js, resources)
    for rp in plans:
        rp.decide(recreate, force)
    return plans


async def apply(settings: NatsSettings, specs: Specs, pipeline: str | None = None, *,
                recreate: bool = False, force: bool = False, data_dir: Path | str | None = None) -> ProvisionReport:
    """Make the server match the spec, all or nothing (see the module docstring for the contract).

    With ``data_dir``, an embedded server recorded there must also run with the store limits
    the spec sets (``settings.max_memory_store``/``max_file_store``).
    Raises :class:`ProvisionRefused` (nothing applied) when a change is refused, and
    :class:`ProvisionError` when the service lacks servers or store limits, or refuses a change.
    """
    p = select_pipeline(specs, pipeline)
    resources = desired_resources(specs, p.name)
    report = ProvisionReport(p.name)
    limits, state = embedded_limits(settings, data_dir), embedded_state(settings, data_dir)
    toggle = cipher_drift(specs, p.name, state)
    async with _jetstream(settings) as (nc, js):
        try:
            await _check_service(nc, specs, p.name, resources, settings, limits)
        except ProvisionError as e:
            e.report = report
            raise
        foreign = await _owned_elsewhere(nc, js, p)
        if foreign:
            raise ProvisionRefused("refused, nothing was applied: the spec's sources name streams or subjects "
                                   "another pipeline owns (isbflow created them for it):\n"
                                   + "\n".join(f"  {line}" for line in foreign)
                                   + "\n  -> name your producers' own stream and subject", report)
        plans = await _plan(js, resources)
        for rp in plans:
            rp.decide(recreate, force)
        if toggle and state:  # jetstream.encryption changed: drained buffers recreated on a restarted server
            if why := await toggle_refusal(nc, plans, toggle, state, force, settings.display):
                raise ProvisionRefused(why, report)
            await drop(js, plans)
        elif any(rp.refusal for rp in plans):
            for rp in plans:
                if rp.refusal:
                    report.resources.append(rp.result(Action.REFUSED, message=rp.refusal))
                else:
                    skipped = Action.UNCHANGED if rp.action == Action.UNCHANGED else Action.SKIPPED
                    report.resources.append(rp.result(skipped))
            raise ProvisionRefused(refusal_message(plans), report)
        else:
            for rp in plans:
                try:
                    report.resources.append(await _execute(js, rp, settings))
                except ProvisionError as e:
                    e.report = report
                    raise
    if toggle and state:
        restart(state, toggle[0])
        report = await apply(settings, specs, pipeline, recreate=recreate, force=force, data_dir=data_dir)
        for r, rp in zip(report.resources, plans, strict=True):
            if rp.exists and rp.resource.managed:
                r.action, r.message = Action.RECREATED, recreated_message(toggle)
    return report


async def diff(settings: NatsSettings, specs: Specs, pipeline: str | None = None, *,
               data_dir: Path | str | None = None) -> list[Drift]:
    """Every difference between spec and server, missing resources included, and partitions beyond
    a vertex's ``partitions`` (:func:`isbflow.isb.provision_partitions.extra_partitions`), each with
    the class its change would have now (:class:`ChangeClass`); [] when in sync. Changes nothing.

    With ``data_dir``, store limits the spec sets that the embedded server recorded there does
    not run with come first (resource ``nats-server``, class ``recreate``: a server restart)."""
    name = select_pipeline(specs, pipeline).name
    out: list[Drift] = [
        Drift("nats-server", "server", f"settings.{f}", want, have, ChangeClass.RECREATE,
              reason="applies when isbflow starts the embedded server: restart it from the spec")
        for f, want, have in store_drift(specs, name, embedded_limits(settings, data_dir))]
    if drift := cipher_drift(specs, name, embedded_state(settings, data_dir)):
        out.append(Drift("nats-server", "server", "jetstream.encryption", drift[0], drift[1], ChangeClass.RECREATE,
                         reason="recreates every buffer, drained: 'isbflow isb apply --force'"))
    for rp in await plan(settings, specs, pipeline):
        r = rp.resource
        if not rp.exists:
            out.append(Drift(r.name, r.kind, "exists", True, False))
            continue
        if not r.managed:
            continue
        unread = rp.holding.unread
        out.extend(Drift(r.name, r.kind, c.field, c.new, c.old, c.cls, unread, c.reason) for c in rp.changes)
        if not rp.changes and rp.meta is not None:
            out.append(Drift(r.name, r.kind, HASH_KEY, rp.meta.new, rp.meta.old, unread=unread))
    async with _jetstream(settings) as (nc, _):  # partitions beyond the spec's count (a rescale removes them)
        out.extend(await extra_partitions(nc, select_pipeline(specs, pipeline)))
    return out


_SHOWN_CONFIG = ("retention", "storage", "max_msgs", "max_bytes", "max_age", "discard", "num_replicas",
                 "duplicate_window", "max_msg_size", "max_msgs_per_subject")


async def status(settings: NatsSettings, specs: Specs, pipeline: str | None = None) -> list[StreamStatus]:
    """Server state of every resource of the pipeline, in :func:`desired_resources` order."""
    resources = desired_resources(specs, pipeline)
    out: list[StreamStatus] = []
    async with _jetstream(settings) as (_, js):
        for r in resources:
            info = await _info(js, r.stream)
            if info is None:
                out.append(StreamStatus(r.name, r.kind, exists=False))
                continue
            st, cl = info.state, info.cluster
            peers = [ReplicaHealth(p.name, p.current, p.offline, p.lag, None if p.active is None else p.active / 1e9)
                     for p in (cl.replicas or [])] if cl else []
            config = {k: getattr(info.config, k, None) for k in _SHOWN_CONFIG}
            out.append(StreamStatus(
                r.name, r.kind, True, st.messages, st.bytes, st.first_seq, st.last_seq, st.consumer_count,
                info.config.num_replicas or 1, cl.leader if cl else None, peers, config))
    return out


async def delete(settings: NatsSettings, specs: Specs, pipeline: str | None = None) -> list[str]:
    """Delete the pipeline's streams and buckets (their data is lost); returns the names deleted.

    Unmanaged source streams (named in the spec with ``stream:``) are kept. All or nothing:
    when any stream's metadata names another owner (:func:`isbflow.isb.provision_plan.foreign_owner`),
    :class:`ProvisionRefused` names each one and nothing is deleted.
    """
    resources = [r for r in desired_resources(specs, pipeline) if r.managed]
    deleted: list[str] = []
    async with _jetstream(settings) as (_, js):
        plans = []
        for r in resources:
            info = await _info(js, r.stream)
            plans.append(ResourcePlan(r, info, owner=foreign_owner(r, info.config.metadata) if info else ""))
        foreign = [p for p in plans if p.owner]
        if foreign:
            report = ProvisionReport(select_pipeline(specs, pipeline).name, [
                ResourceResult(p.resource.name, p.resource.kind, Action.REFUSED if p.owner else Action.SKIPPED,
                               message=f"owned by {p.owner}" if p.owner else "")
                for p in plans if p.exists])
            lines = "\n".join(f"  {p.resource.name}: owned by {p.owner}, not by {owner_text(p.resource.labels)}"
                              for p in foreign)
            raise ProvisionRefused(f"refused, nothing was deleted: {len(foreign)} stream(s) carry metadata naming "
                                   f"another owner (isbflow never deletes another owner's stream):\n{lines}", report)
        for p in plans:
            if not p.exists:
                continue
            try:
                await js.delete_stream(p.resource.stream)
            except NotFoundError:
                continue
            deleted.append(p.resource.name)
    return deleted
