"""Who may do what on the ISB service: one NATS user per role, each with the least it needs.

=================  ==============================================================
user               may
=================  ==============================================================
``isbflow``        everything (the admin: provisioning, the platform, recovery,
                   replay, reference loads, Airflow's operators)
``reader``         read metadata (stream and consumer info, account info) and get
                   the control, status and ledger keys of the granted pipelines;
                   publish nothing, create no consumer, read no buffer
``producer``       publish to the granted pipelines' source subjects (and read the
                   source streams' info); read nothing, write no key
``pipeline-<p>``   what pipeline ``p``'s drivers need on ``p``'s own streams and
                   buckets only: publish to ``isb.<p>.>``, read its buffers and
                   source streams (direct gets, purges of what was committed), get
                   and put its control, status and ledger keys, get its reference
                   tables; create no consumer; nothing of another pipeline
=================  ==============================================================

Every role but the admin receives its replies on its own inbox prefix
(:func:`inbox_prefix`, ``_INBOX_<user>``) and may subscribe there only, so no
role can listen to another's replies (a direct get's reply carries buffer data).

:func:`pipeline_grants` derives a pipeline's grants from its spec (the names of
:mod:`isbflow.spec.derived`); :func:`authorization_block` renders the users for a
nats-server config, which is also how an external server is configured
(docs/operations/nats-roles.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from isbflow.isb import naming
from isbflow.spec import derived

if TYPE_CHECKING:
    from isbflow.spec.models import Pipeline

ADMIN = "isbflow"
READER = "reader"
PRODUCER = "producer"
JS = "$JS.API"


def pipeline_user(pipeline: str) -> str:
    """The user of pipeline ``pipeline``'s drivers."""
    return f"pipeline-{pipeline}"


def is_role_user(user: str) -> bool:
    """A user of a role with its own inbox (any but the admin)."""
    return user in (READER, PRODUCER) or user.startswith("pipeline-")


def inbox_prefix(user: str) -> str | None:
    """The inbox prefix a role's client must use (``None``: the default ``_INBOX``, admin only)."""
    return None if user == ADMIN else f"_INBOX_{user}"


@dataclass(frozen=True)
class PipelineGrant:
    """The names one pipeline owns on the ISB service (what its role may reach)."""

    pipeline: str
    buffers: tuple[str, ...]  # edge streams, every partition
    sources: tuple[str, ...]  # streams of its JetStream sources
    source_subjects: tuple[str, ...]  # what its producers publish to
    dlq: str
    buckets: tuple[str, ...]  # control, status, ledger
    references: tuple[str, ...]  # reference table buckets (read only)

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}

    @classmethod
    def from_json(cls, d: dict) -> PipelineGrant:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def pipeline_grants(p: Pipeline) -> PipelineGrant:
    """What pipeline ``p`` owns, from its spec."""
    name = p.name
    parts = {v.name: v.partitions for v in p.spec.vertices}
    buffers = [derived.edge_stream(name, e.from_, e.to, i) for e in p.spec.edges for i in range(parts.get(e.to, 1))]
    sources, subjects, refs = [], [], []
    for v in p.spec.vertices:
        js = v.source.jetstream if v.source is not None else None
        if js is not None:
            sources.append(derived.source_stream(name, v.name, js.stream))
            subjects.append(js.subject)
        refs += [derived.reference_bucket(name, r.name) for r in (v.udf.references if v.udf is not None else [])]
    return PipelineGrant(
        name, tuple(buffers), tuple(sources), tuple(subjects), derived.dlq_stream(name),
        (derived.control_bucket(name), derived.status_bucket(name), derived.ledger_bucket(name)), tuple(refs))


@dataclass(frozen=True)
class Permissions:
    """One user's ``permissions`` block: subjects it may publish to and subscribe on."""

    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    everything: bool = False  # the admin: no permissions block at all

    def block(self) -> str:
        if self.everything:
            return ""
        pub = ", ".join(json.dumps(s) for s in self.publish)
        sub = ", ".join(json.dumps(s) for s in self.subscribe)
        return f"permissions: {{ publish: {{ allow: [{pub}] }}, subscribe: {{ allow: [{sub}] }} }}"


def _kv_get(bucket: str) -> list[str]:
    stream = f"KV_{bucket}"
    return [f"{JS}.STREAM.INFO.{stream}", f"{JS}.DIRECT.GET.{stream}", f"{JS}.DIRECT.GET.{stream}.>",
            f"{JS}.STREAM.MSG.GET.{stream}"]


def _read_stream(stream: str) -> list[str]:
    """Reading a stream the way a pipeline's drivers do: info and (batched) direct gets.

    No consumer of any kind: nats-server does not check a push consumer's ``deliver_subject``
    against its creator's publish rights (nats-server issue 8274), and every form of the create
    request (``CONSUMER.CREATE.<stream>``, ``.<consumer>``, ``.<consumer>.<filter>``) takes a
    ``deliver_subject`` in its body, so a user allowed to create any consumer could have the server
    deliver its own stream into another pipeline's buffer subject."""
    return [f"{JS}.STREAM.INFO.{stream}", f"{JS}.DIRECT.GET.{stream}", f"{JS}.DIRECT.GET.{stream}.>",
            f"{JS}.STREAM.MSG.GET.{stream}"]


def _inbox(user: str) -> tuple[str, ...]:
    return (f"{inbox_prefix(user)}.>",)


def reader_permissions(grants: Iterable[PipelineGrant]) -> Permissions:
    pub = [f"{JS}.INFO", f"{JS}.STREAM.INFO.>", f"{JS}.STREAM.NAMES", f"{JS}.STREAM.LIST",
           f"{JS}.CONSUMER.INFO.>", f"{JS}.CONSUMER.NAMES.>", f"{JS}.CONSUMER.LIST.>"]
    for g in grants:
        for b in g.buckets:
            pub += _kv_get(b)
    return Permissions(tuple(pub), _inbox(READER))


def producer_permissions(grants: Iterable[PipelineGrant]) -> Permissions:
    pub: list[str] = []
    for g in grants:
        pub += g.source_subjects
        pub += [f"{JS}.STREAM.INFO.{s}" for s in g.sources]
    return Permissions(tuple(dict.fromkeys(pub)), _inbox(PRODUCER))


def pipeline_permissions(g: PipelineGrant) -> Permissions:
    pub = [f"isb.{g.pipeline}.>", f"{JS}.INFO"]
    for s in (*g.buffers, *g.sources):  # read, and purged up to what the step committed (isb.release)
        pub += [*_read_stream(s), f"{JS}.STREAM.PURGE.{s}"]
    pub += _read_stream(g.dlq)  # dead letters are published to isb.<p>.dlq.<step>, never purged by a driver
    for b in g.buckets:
        pub += [*_read_stream(f"KV_{b}"), f"$KV.{b}.>"]
    for b in g.references:
        pub += _read_stream(f"KV_{b}")
    # its own streams' RePublish subjects (headers only): how an idle step waits for its input to grow
    wake = tuple(naming.wake_subject(s) for s in (*g.buffers, *g.sources))
    return Permissions(tuple(dict.fromkeys(pub)), _inbox(pipeline_user(g.pipeline)) + wake)


def role_permissions(grants: Sequence[PipelineGrant]) -> dict[str, Permissions]:
    """Every user and its permissions, for the pipelines granted so far."""
    out = {ADMIN: Permissions(everything=True), READER: reader_permissions(grants),
           PRODUCER: producer_permissions(grants)}
    out.update({pipeline_user(g.pipeline): pipeline_permissions(g) for g in grants})
    return out


def authorization_block(passwords: dict[str, str], grants: Sequence[PipelineGrant]) -> str:
    """The ``authorization { users = [...] }`` block of a nats-server config: one entry per user of
    :func:`role_permissions` that has a password in ``passwords``."""
    lines = []
    for user, perms in role_permissions(grants).items():
        if user not in passwords:
            continue
        entry = f'{{ user: "{user}", password: "{passwords[user]}"'
        block = perms.block()
        lines.append(f"    {entry}{', ' + block if block else ''} }}")
    return "authorization {\n  timeout: 5\n  users = [\n" + ",\n".join(lines) + "\n  ]\n}"
