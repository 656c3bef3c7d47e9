"""A vertex's input buffers as the ISB service holds them, partition by partition.

A vertex with ``partitions: N`` reads one stream per partition of each of its in edges
(:func:`isbflow.isb.naming.edge_partitions`). The server may hold another number of them:
the spec changed and was not applied yet, or applied by ``isb apply``, which creates the
partitions a larger number adds and never removes any. A rescale
(:mod:`isbflow.ops.rescale`) reads what the server holds here before it changes the number,
and removes the partitions a smaller number leaves behind.

- :func:`held_partitions`: every stream the server holds for the buffers into a vertex, with
  its message count, last sequence and **unread** count, judged as provisioning
  judges it (:func:`isbflow.isb.provision_plan.holding`): every message of a WorkQueue or
  Interest buffer (isbflow purges what was committed downstream), the messages above the
  sequence the reading vertex committed for a Limits one (every message when none is
  recorded);
- :func:`extra_partitions`: the partitions the server holds beyond the spec's count, as drift
  (``isb diff`` lists them; ``isb apply`` leaves them: only a rescale removes a partition, once
  it is read);
- :func:`remove_partitions`: delete streams and the committed sequences the status bucket
  keeps for them, so a partition created again later under the same name starts with no
  record of the old one. It deletes what it is given: checking that nothing unread goes is
  the caller's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from isbflow.isb import control, naming
from isbflow.isb.provision_plan import holding
from isbflow.isb.provision_report import ChangeClass, Drift
from isbflow.isb.provision_resources import Resource
from isbflow.isb.state import committed_key, get_committed
from isbflow.isb.store import has_buffer_role
from isbflow.spec import derived
from isbflow.spec.fields import MAX_PARTITIONS

if TYPE_CHECKING:
    import nats.aio.client

    from isbflow.spec.models import Pipeline


@dataclass(frozen=True)
class HeldPartition:
    """One stream of a buffer into a vertex, as the server holds it now."""

    stream: str
    from_vertex: str
    to_vertex: str
    partition: int
    messages: int
    unread: int
    last_seq: int

    @property
    def edge(self) -> str:
        return f"{self.from_vertex}->{self.to_vertex}"

    def to_json(self) -> dict:
        return {"stream": self.stream, "edge": self.edge, "partition": self.partition,
                "messages": self.messages, "unread": self.unread, "last_seq": self.last_seq}


async def _names(nc: nats.aio.client.Client, subject: str) -> list[str]:
    """The streams whose subjects take ``subject`` (a wildcard), as the server lists them."""
    reply = await nc.request("$JS.API.STREAM.NAMES", json.dumps({"subject": subject}).encode(), timeout=10)
    return json.loads(reply.data).get("streams") or []


async def _held_on_store(store: Any, p: Pipeline, vertex: str) -> list[HeldPartition]:
    """:func:`held_partitions` on a store object: each partition that has an incarnation; unread,
    what it holds above the sequence the reading vertex committed (every entry when none is)."""
    out: list[HeldPartition] = []
    for e in p.inputs(vertex):
        for i in range(MAX_PARTITIONS):
            name = derived.edge_stream(p.name, e.from_, vertex, i)
            info = await store.buffers().state(name)
            if info is None:
                continue
            committed = await get_committed(store, p.name, vertex, name) or 0
            unread = min(info.messages, max(0, info.last_seq - committed))
            out.append(HeldPartition(name, e.from_, vertex, i, info.messages, unread, info.last_seq))
    return out


async def _remove_on_store(store: Any, p: Pipeline, vertex: str, streams: list[str]) -> list[str]:
    """:func:`remove_partitions` on a store object."""
    status = await control.kv(store, naming.status_bucket(p.name))
    deleted = []
    for s in streams:
        if await store.buffers().state(s) is not None:
            await store.buffer(s).delete()
            deleted.append(s)
        await status.delete(committed_key(vertex, s))
    return deleted


async def held_partitions(nc: nats.aio.client.Client, p: Pipeline, vertex: str) -> list[HeldPartition]:
    """Every partition stream the server holds for the buffers into ``vertex``, edge by edge in the
    spec's order, partitions in order (see the module docstring for *unread*); on a store object
    (Redis) every partition with an incarnation."""
    if has_buffer_role(nc):
        return await _held_on_store(nc, p, vertex)
    js = nc.jetstream()
    out: list[HeldPartition] = []
    for e in p.inputs(vertex):
        known = {derived.edge_stream(p.name, e.from_, vertex, i): i for i in range(MAX_PARTITIONS)}
        wildcard = derived.edge_subject(p.name, e.from_, vertex, 0).rsplit(".", 1)[0] + ".*"
        names = sorted((n for n in await _names(nc, wildcard) if n in known), key=known.__getitem__)
        for name in names:
            try:
                info = await js.stream_info(name)
            except NotFoundError:  # removed meanwhile
                continue
            reader = Resource(name, "stream", {}, {"isbflow.pipeline": p.name}, reader=vertex)
            held = await holding(js, reader, info, need_age=False)
            out.append(HeldPartition(name, e.from_, vertex, known[name], held.messages, held.unread,
                                     info.state.last_seq))
    return out


async def extra_partitions(nc: nats.aio.client.Client, p: Pipeline) -> list[Drift]:
    """One drift (field ``exists``: spec False, server True) per partition stream the server holds
    beyond the spec's ``partitions`` of the vertex it feeds; class ``may-discard`` when it holds
    unread messages."""
    out = []
    for v in p.spec.vertices:
        if not p.inputs(v.name):
            continue
        for h in await held_partitions(nc, p, v.name):
            if h.partition >= v.partitions:
                out.append(Drift(h.stream, "stream", "exists", False, True,
                                 ChangeClass.MAY_DISCARD if h.unread else ChangeClass.SAFE, h.unread,
                                 f"partition {h.partition} of buffer {h.edge}, beyond the spec's partitions: "
                                 f"{v.partitions}; 'isbflow pipeline rescale' removes it once it is read"))
    return out


async def remove_partitions(nc: nats.aio.client.Client, p: Pipeline, vertex: str, streams: list[str]) -> list[str]:
    """Delete ``streams`` (partitions of buffers into ``vertex``) and their committed sequences in the
    status bucket; the names deleted (a stream already gone is skipped)."""
    if has_buffer_role(nc):
        return await _remove_on_store(nc, p, vertex, streams)
    js = nc.jetstream()
    try:
        kv = await js.key_value(naming.status_bucket(p.name))
    except NatsError:
        kv = None
    deleted = []
    for s in streams:
        try:
            await js.delete_stream(s)
            deleted.append(s)
        except NotFoundError:
            pass
        if kv is not None:
            try:
                await kv.purge(committed_key(vertex, s))
            except NatsError:
                pass
    return deleted
