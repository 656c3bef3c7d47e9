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
use batched direct gets). Report fields use these JetStream names.

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
``isbflow.edge`` and ``isbflow.partition``, and ``isbflow.spec-hash``: a hash of
the managed fields as provisioned, so drift is detectable from the server alone.

Contract of :func:`apply` (idempotent; a second run reports every resource
``unchanged``): it creates what is missing, updates in place what JetStream can
update (limits, replicas, duplicates, max_msg_size, discard, description,
metadata) and reports ``drift`` for what it cannot (``storage``, ``retention``),
leaving that resource's data alone. With ``recreate=True`` such a stream is
deleted and created again, unless it still holds messages: then it is
``refused`` (nothing touched) unless ``force=True``. Server refusals (e.g.
replicas above the cluster size) raise :class:`ProvisionError` naming the
resource and what to do.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from enum import Enum, StrEnum
from typing import TYPE_CHECKING, Any, Literal

from nats.errors import Error as NatsError
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
)
from nats.js.errors import NotFoundError

from isbflow.isb import naming
from isbflow.isb.connect import NatsSettings, session
from isbflow.isb.release import interest_hold_consumer
from isbflow.spec.load import Specs
from isbflow.spec.models import Pipeline, Retention, Storage

if TYPE_CHECKING:
    from nats.js import JetStreamContext

Kind = Literal["stream", "kv"]

#: Fields JetStream cannot change on an existing stream: changing them needs a recreate.
IMMUTABLE_FIELDS = frozenset({"storage", "retention"})
META_PREFIX = "isbflow."
HASH_KEY = "isbflow.spec-hash"
KV_HISTORY = {"control": 5, "status": 1, "ledger": 5}

_RETENTION = {
    Retention.LIMITS: RetentionPolicy.LIMITS,
    Retention.INTEREST: RetentionPolicy.INTEREST,
    Retention.WORK_QUEUE: RetentionPolicy.WORK_QUEUE,
}
_STORAGE = {Storage.FILE: StorageType.FILE, Storage.MEMORY: StorageType.MEMORY}
_DURATIONS = frozenset({"max_age", "duplicate_window"})
_DEFAULT_DUPLICATES = 120.0  # what the server stores when duplicate_window is 0


class ProvisionError(Exception):
    """The ISB service refused a change; the message names the resource and what to do.

    ``report`` holds what was done before the refusal.
    """

    def __init__(self, message: str, report: ProvisionReport | None = None):
        super().__init__(message)
        self.report = report


class Action(StrEnum):
    CREATED = "created"
    UPDATED = "updated"
    UNCHANGED = "unchanged"
    DRIFT = "drift"  # differs in a field that needs a recreate; left alone
    RECREATED = "recreated"
    REFUSED = "refused"  # recreate asked for but the stream holds messages


# ------------------------------------------------------------------ desired state


@dataclass(frozen=True)
class Resource:
    """One thing isbflow provisions: a stream or a KV bucket, with its managed fields.

    ``fields`` uses JetStream's config names and values (enums, seconds);
    ``stream`` is the server-side stream (``KV_<bucket>`` for a bucket).
    An unmanaged resource (a source stream the spec names with ``stream:``, which
    its producers own) is created when missing and otherwise never changed.
    """

    name: str
    kind: Kind
    fields: dict[str, Any]
    labels: dict[str, str]
    managed: bool = True

    @property
    def stream(self) -> str:
        return f"KV_{self.name}" if self.kind == "kv" else self.name

    def metadata(self, fields: dict[str, Any] | None = None) -> dict[str, str]:
        """Labels plus the hash of ``fields`` (default: the desired ones)."""
        return {**self.labels, HASH_KEY: spec_hash(self.fields if fields is None else fields)}


def spec_hash(fields: dict[str, Any]) -> str:
    data = json.dumps({k: _plain(v) for k, v in sorted(fields.items())}, sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def select_pipeline(specs: Specs, pipeline: str | None = None) -> Pipeline:
    """The named pipeline, or the only one when ``pipeline`` is None (else :class:`SpecError`)."""
    return specs.select(pipeline)


def discard_policy(retention: Retention, max_msgs: int, max_bytes: int) -> DiscardPolicy:
    """``new`` for a bounded WorkQueue/Interest buffer, else ``old`` (module docstring says why)."""
    bounded = max_msgs > 0 or max_bytes > 0
    return DiscardPolicy.NEW if bounded and retention != Retention.LIMITS else DiscardPolicy.OLD


def desired_resources(specs: Specs, pipeline: str | None = None) -> list[Resource]:
    """Every stream and bucket the pipeline needs, configured from its ISB service. Pure."""
    p = select_pipeline(specs, pipeline)
    jet = specs.service_for(p).spec.jetstream
    sc = jet.bufferConfig.stream
    duplicates = sc.duplicates or (min(_DEFAULT_DUPLICATES, sc.maxAge) if sc.maxAge else _DEFAULT_DUPLICATES)
    base = {
        "retention": _RETENTION[sc.retention],
        "storage": _STORAGE[sc.storage],
        "max_msgs": sc.maxMsgs,
        "max_bytes": sc.maxBytes,
        "max_age": sc.maxAge,
        "num_replicas": sc.replicas,
        "duplicate_window": duplicates,
        "max_msg_size": jet.settings.max_payload,
        "discard": discard_policy(sc.retention, sc.maxMsgs, sc.maxBytes),
        "allow_direct": True,
    }
    out: list[Resource] = []

    def stream(name: str, subjects: list[str], description: str, managed: bool = True, **labels: str) -> None:
        fields = {**base, "subjects": subjects, "description": description}
        out.append(Resource(name, "stream", fields, {"isbflow.pipeline": p.name, **labels}, managed))

    for v in p.spec.vertices:
        if v.source is not None and v.source.jetstream is not None:
            stream(naming.source_stream(p, v.name), [v.source.jetstream.subject],
                   f"isbflow pipeline {p.name}: events of source {v.name}",
                   managed=v.source.jetstream.stream is None,
                   **{"isbflow.role": "source", "isbflow.vertex": v.name})
    for ep in naming.edge_partitions(p):
        stream(ep.stream, [ep.subject],
               f"isbflow pipeline {p.name}: buffer {ep.from_vertex} -> {ep.to_vertex}, partition {ep.partition}",
               **{"isbflow.role": "edge", "isbflow.edge": f"{ep.from_vertex}->{ep.to_vertex}",
                  "isbflow.partition": str(ep.partition)})
    stream(naming.dlq_stream(p.name), [f"isb.{p.name}.dlq.>"],
           f"isbflow pipeline {p.name}: dead letters", **{"isbflow.role": "dlq"})
    storage = StorageType.FILE if jet.persistence else StorageType.MEMORY
    for role, bucket in (("control", naming.control_bucket(p.name)), ("status", naming.status_bucket(p.name)),
                         ("ledger", naming.ledger_bucket(p.name))):
        fields = {
            "description": f"isbflow pipeline {p.name}: {role}",
            "storage": storage,
            "num_replicas": sc.replicas,
            "max_msgs_per_subject": KV_HISTORY[role],
            "allow_direct": True,
        }
        out.append(Resource(bucket, "kv", fields, {"isbflow.pipeline": p.name, "isbflow.role": role}))
    return out


# ------------------------------------------------------------------ reports


def _plain(v: Any) -> Any:
    return v.value if isinstance(v, Enum) else v


def _same(name: str, a: Any, b: Any) -> bool:
    if name in _DURATIONS:
        return round((a or 0) * 1e9) == round((b or 0) * 1e9)
    return _plain(a) == _plain(b)


@dataclass(frozen=True)
class FieldChange:
    field: str
    old: Any
    new: Any
    applied: bool

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "old": _plain(self.old), "new": _plain(self.new), "applied": self.applied}

    def __str__(self) -> str:
        mark = "" if self.applied else " (needs --recreate)"
        return f"{self.field}: {_plain(self.old)} -> {_plain(self.new)}{mark}"


@dataclass
class ResourceResult:
    name: str
    kind: Kind
    action: Action
    changes: list[FieldChange] = field(default_factory=list)
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "action": self.action.value,
                "changes": [c.to_json() for c in self.changes], "message": self.message}


@dataclass
class ProvisionReport:
    pipeline: str
    resources: list[ResourceResult] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """True when the server was modified (created, updated, recreated anything, or updated
        the in-place fields of a resource left in drift)."""
        return any(r.action in (Action.CREATED, Action.UPDATED, Action.RECREATED)
                   or (r.action == Action.DRIFT and any(c.applied for c in r.changes))
                   for r in self.resources)

    @property
    def pending(self) -> list[ResourceResult]:
        """Resources still differing from the spec after apply (drift or refused)."""
        return [r for r in self.resources if r.action in (Action.DRIFT, Action.REFUSED)]

    def to_json(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "changed": self.changed, "pending": len(self.pending),
                "resources": [r.to_json() for r in self.resources]}


@dataclass(frozen=True)
class Drift:
    """One difference between spec and server; ``field == "exists"`` for a missing resource."""

    resource: str
    kind: Kind
    field: str
    spec: Any
    server: Any

    def to_json(self) -> dict[str, Any]:
        return {"resource": self.resource, "kind": self.kind, "field": self.field,
                "spec": _plain(self.spec), "server": _plain(self.server)}


@dataclass(frozen=True)
class ReplicaHealth:
    name: str | None
    current: bool | None
    offline: bool | None
    lag: int | None
    active: float | None  # seconds since the peer was last seen


@dataclass
class StreamStatus:
    """Server state of one resource; ``exists`` False when it is missing (numbers then 0)."""

    name: str
    kind: Kind
    exists: bool
    messages: int = 0
    bytes: int = 0
    first_seq: int = 0
    last_seq: int = 0
    consumer_count: int = 0
    replicas: int = 0
    leader: str | None = None
    peers: list[ReplicaHealth] = field(default_factory=list)

    @property
    def values(self) -> int | None:
        """For a KV bucket: values stored (history included), as ``nats kv status`` counts."""
        return self.messages if self.kind == "kv" else None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["values"] = self.values
        return d


# ------------------------------------------------------------------ server side


@asynccontextmanager
async def _jetstream(settings: NatsSettings) -> AsyncIterator[JetStreamContext]:
    async with session(settings, name="isbflow-provision") as nc:
        # creating an R3 stream forms a raft group: allow for a busy small machine
        yield nc.jetstream(timeout=30.0)


async def _info(js: JetStreamContext, stream: str) -> StreamInfo | None:
    try:
        return await js.stream_info(stream)
    except NotFoundError:
        return None


def _compare(r: Resource, config: StreamConfig) -> tuple[list[FieldChange], FieldChange | None]:
    """Field differences (immutable ones not applied) and a metadata difference, if any.

    The metadata expected is the one of the state after an in-place update:
    desired fields, with immutable fields kept at the server's values.
    """
    changes = []
    for name, want in r.fields.items():
        have = getattr(config, name)
        if not _same(name, have, want):
            changes.append(FieldChange(name, have, want, applied=name not in IMMUTABLE_FIELDS))
    post = {**r.fields, **{c.field: c.old for c in changes if not c.applied}}
    want_meta = r.metadata(post)
    have_meta = {k: v for k, v in (config.metadata or {}).items() if k.startswith(META_PREFIX)}
    meta = None
    if have_meta != want_meta:
        meta = FieldChange("metadata", have_meta.get(HASH_KEY), want_meta[HASH_KEY], applied=True)
    return changes, meta


def _server_error(verb: str, r: Resource, settings: NatsSettings, e: Exception) -> ProvisionError:
    desc = getattr(e, "description", None) or str(e) or type(e).__name__
    what = f"{verb} {'KV bucket' if r.kind == 'kv' else 'stream'} {r.name} on the ISB service at {settings.display}"
    hint = ""
    replicas = r.fields.get("num_replicas", 1)
    if replicas > 1 and ("replicas" in desc.lower() or "insufficient resources" in desc.lower()):
        hint = (f": bufferConfig.stream.replicas is {replicas}, so the service needs a JetStream cluster "
                f"of at least {replicas} servers (e.g. 'isbflow nats up --cluster 3'); "
                "or lower bufferConfig.stream.replicas")
    elif "insufficient storage" in desc.lower() and r.fields.get("max_bytes", -1) > 0:
        hint = (f": JetStream reserves max_bytes ({r.fields['max_bytes']} bytes, bufferConfig.stream.maxBytes) "
                "for every stream up front; lower maxBytes, or give the server more "
                f"{'memory' if r.fields['storage'] == StorageType.MEMORY else 'file'} store "
                "(jetstream max_file_store / max_memory_store)")
    return ProvisionError(f"{what} failed: {desc}{hint}")


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


async def _apply_one(js: JetStreamContext, r: Resource, settings: NatsSettings,
                     recreate: bool, force: bool) -> ResourceResult:
    info = await _info(js, r.stream)
    if info is None:
        try:
            await _create(js, r)
        except NatsError as e:
            raise _server_error("creating", r, settings, e) from None
        return ResourceResult(r.name, r.kind, Action.CREATED)
    if not r.managed:
        return ResourceResult(r.name, r.kind, Action.UNCHANGED, message="named in the spec: not managed")
    await _ensure_hold(js, r)
    changes, meta = _compare(r, info.config)
    needs_recreate = [c for c in changes if not c.applied]
    if needs_recreate and recreate:
        held = info.state.messages
        if held > 0 and not force:
            return ResourceResult(
                r.name, r.kind, Action.REFUSED, changes,
                f"holds {held} message(s) that a recreate would lose; drain the pipeline first, "
                "or pass --force to drop them")
        try:
            await js.delete_stream(r.stream)
            await _create(js, r)
        except NatsError as e:
            raise _server_error("recreating", r, settings, e) from None
        applied = [FieldChange(c.field, c.old, c.new, applied=True) for c in changes]
        return ResourceResult(r.name, r.kind, Action.RECREATED, applied,
                              f"dropped {held} message(s)" if held else "")
    in_place = {c.field: c.new for c in changes if c.applied}
    if in_place or meta is not None:
        post = {**r.fields, **{c.field: c.old for c in needs_recreate}}
        try:
            await js.update_stream(_updated(info.config, in_place, r.metadata(post)))
        except NatsError as e:
            raise _server_error("updating", r, settings, e) from None
    shown = changes if changes else ([meta] if meta is not None else [])
    if needs_recreate:
        fields = ", ".join(c.field for c in needs_recreate)
        return ResourceResult(r.name, r.kind, Action.DRIFT, shown,
                              f"{fields} cannot change in place: re-run with --recreate")
    return ResourceResult(r.name, r.kind, Action.UPDATED if shown else Action.UNCHANGED, shown)


# ------------------------------------------------------------------ public API


async def apply(settings: NatsSettings, specs: Specs, pipeline: str | None = None, *,
                recreate: bool = False, force: bool = False) -> ProvisionReport:
    """Make the server match the spec (see the module docstring for the contract)."""
    p = select_pipeline(specs, pipeline)
    resources = desired_resources(specs, p.name)
    report = ProvisionReport(p.name)
    async with _jetstream(settings) as js:
        for r in resources:
            try:
                report.resources.append(await _apply_one(js, r, settings, recreate, force))
            except ProvisionError as e:
                e.report = report
                raise
    return report


async def diff(settings: NatsSettings, specs: Specs, pipeline: str | None = None) -> list[Drift]:
    """Every difference between spec and server, missing resources included; [] when in sync."""
    resources = desired_resources(specs, pipeline)
    out: list[Drift] = []
    async with _jetstream(settings) as js:
        for r in resources:
            info = await _info(js, r.stream)
            if info is None:
                out.append(Drift(r.name, r.kind, "exists", True, False))
                continue
            if not r.managed:
                continue
            changes, meta = _compare(r, info.config)
            out.extend(Drift(r.name, r.kind, c.field, c.new, c.old) for c in changes)
            if not changes and meta is not None:
                out.append(Drift(r.name, r.kind, HASH_KEY, meta.new, meta.old))
    return out


async def status(settings: NatsSettings, specs: Specs, pipeline: str | None = None) -> list[StreamStatus]:
    """Server state of every resource of the pipeline, in :func:`desired_resources` order."""
    resources = desired_resources(specs, pipeline)
    out: list[StreamStatus] = []
    async with _jetstream(settings) as js:
        for r in resources:
            info = await _info(js, r.stream)
            if info is None:
                out.append(StreamStatus(r.name, r.kind, exists=False))
                continue
            st, cl = info.state, info.cluster
            peers = [ReplicaHealth(p.name, p.current, p.offline, p.lag, None if p.active is None else p.active / 1e9)
                     for p in (cl.replicas or [])] if cl else []
            out.append(StreamStatus(
                r.name, r.kind, True, st.messages, st.bytes, st.first_seq, st.last_seq, st.consumer_count,
                info.config.num_replicas or 1, cl.leader if cl else None, peers))
    return out


async def delete(settings: NatsSettings, specs: Specs, pipeline: str | None = None) -> list[str]:
    """Delete the pipeline's streams and buckets (their data is lost); returns the names deleted.

    Unmanaged source streams (named in the spec with ``stream:``) are kept.
    """
    resources = desired_resources(specs, pipeline)
    deleted: list[str] = []
    async with _jetstream(settings) as js:
        for r in resources:
            if not r.managed:
                continue
            try:
                await js.delete_stream(r.stream)
            except NotFoundError:
                continue
            deleted.append(r.name)
    return deleted
