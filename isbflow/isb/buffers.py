"""The buffers of an open connection, whichever store holds them.

The steps, recovery, quality and the faces hold a *connection*: a nats-py client (JetStream) or
a store object (Redis, :class:`isbflow.isb.redis.store.RedisStore`). What they need of its
buffers goes through this module, so none of them asks which store it is:

- :func:`stream_state`: a partition's state (incarnation, first and last offset, how many frames);
- :func:`read_range`: the messages of an offset range, in order, nothing removed;
- :func:`wait_for_append`: block until a partition grows past what a reader has seen;
- :func:`release`: free what the downstream step has committed.

A store object brings its own implementation (its ``buffers()``, a :class:`Buffers`); a nats-py
client gets :class:`JetStreamBuffers`, which calls the JetStream modules (:mod:`isbflow.isb.read`,
:mod:`isbflow.isb.wait`, :mod:`isbflow.isb.release`). Offsets are integers in every store (JetStream
sequences; Redis entry ids ``0-<n>``), so the ledger, the checkpoints and recovery compare them the
same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any, Protocol

from isbflow.isb import read as js_read
from isbflow.isb import release as js_release
from isbflow.isb import wait as js_wait
from isbflow.isb.connect import IsbSettings, close_loop, connect
from isbflow.isb.errors import BufferLost
from isbflow.isb.read import Message, StreamState
from isbflow.isb.store import has_buffer_role, incarnation_gone

__all__ = ["Buffers", "JetStreamBuffers", "Message", "StreamState", "of", "read_partition", "read_range", "recreate_partitions", "release",
           "stream_state", "wait_for_append"]


class Buffers(Protocol):
    """What a store does with its buffers on one open connection."""

    async def state(self, stream: str) -> StreamState | None:
        """The partition's state; None when it does not exist."""
        ...

    def read_range(self, stream: str, first: int, last: int, *,
                   on_gap: Callable[[int, int], None] | None = None) -> AsyncIterator[list[Message]]:
        """The messages of offsets ``first..last`` in order, in lists, each once; a missing offset
        inside the range raises :class:`isbflow.isb.errors.BufferLost` (``on_gap``: reported, skipped)."""
        ...

    async def wait_for_append(self, after: Mapping[str, int], timeout: float,
                              cancelled: Callable[[], bool] = lambda: False) -> bool:
        """True as soon as a partition of ``after`` holds an offset past its value; False after
        ``timeout`` seconds or once ``cancelled()``."""
        ...

    async def release(self, stream: str, upto: int, retention: object, incarnation: str | None = None) -> int:
        """Free the partition's frames up to ``upto`` (committed downstream); how many. Nothing when
        the partition is no longer ``incarnation`` or its retention keeps everything (``limits``)."""
        ...


class JetStreamBuffers:
    """:class:`Buffers` on a nats-py client."""

    def __init__(self, nc: Any):
        self.nc = nc

    async def state(self, stream: str) -> StreamState | None:
        return await js_read.stream_state(self.nc, stream)

    def read_range(self, stream: str, first: int, last: int, *,
                   on_gap: Callable[[int, int], None] | None = None, **kw) -> AsyncIterator[list[Message]]:
        return js_read.read_range(self.nc, stream, first, last, on_gap=on_gap, **kw)

    async def wait_for_append(self, after: Mapping[str, int], timeout: float,
                              cancelled: Callable[[], bool] = lambda: False) -> bool:
        return await js_wait.wait_for_append(self.nc, after, timeout, cancelled)

    async def release(self, stream: str, upto: int, retention: object, incarnation: str | None = None) -> int:
        return await js_release.release(None, stream, upto, retention, incarnation=incarnation, nc=self.nc)


def of(conn: Any) -> Buffers:
    """The buffers of ``conn``: its own when it is a store object, else JetStream's."""
    own = getattr(conn, "buffers", None)
    if own is not None and callable(own):
        return own()
    return JetStreamBuffers(conn)


async def stream_state(conn: Any, stream: str) -> StreamState | None:
    """:meth:`Buffers.state` of ``conn``'s store."""
    return await of(conn).state(stream)


def read_range(conn: Any, stream: str, first: int, last: int, *,
               on_gap: Callable[[int, int], None] | None = None, **kw) -> AsyncIterator[list[Message]]:
    """:meth:`Buffers.read_range` of ``conn``'s store (``kw``: a store's own read options)."""
    return of(conn).read_range(stream, first, last, on_gap=on_gap, **kw)


async def wait_for_append(conn: Any, after: Mapping[str, int], timeout: float,
                          cancelled: Callable[[], bool] = lambda: False) -> bool:
    """:meth:`Buffers.wait_for_append` of ``conn``'s store."""
    return await of(conn).wait_for_append(after, timeout, cancelled)


async def release(conn: Any, stream: str, upto: int, retention: object, incarnation: str | None = None) -> int:
    """:meth:`Buffers.release` of ``conn``'s store."""
    return await of(conn).release(stream, upto, retention, incarnation)


def read_partition(settings: IsbSettings, stream: str, incarnation: str, first: int, last: int, *,
                   on_gap: Callable[[int, int], None] | None = None,
                   on_recreated: Callable[[str], None] | None = None,
                   prefer_consumer: bool = False, keep_headers: bool = True) -> Iterator[list[Message]]:
    """Synchronous range read for one Spark task (an executor has no loop nor connection), checking
    the incarnation before and after, with :func:`isbflow.isb.read.read_partition`'s contract:
    the partition must be ``incarnation`` before the read and still after it, else
    :class:`BufferLost`; with ``on_recreated`` a partition already gone or recreated *before* the
    read is reported there and nothing is yielded. JetStream keeps its own path (its consumer
    read for events, ``prefer_consumer``/``keep_headers``); another store reads through its
    :class:`Buffers`."""
    if getattr(settings, "store", "jetstream") == "jetstream":
        yield from js_read.read_partition(settings, stream, incarnation, first, last, on_gap=on_gap,
                                          on_recreated=on_recreated, prefer_consumer=prefer_consumer,
                                          keep_headers=keep_headers)
        return
    loop = asyncio.new_event_loop()
    try:
        conn = loop.run_until_complete(connect(settings, name=f"isbflow-read-{stream}"))
        try:
            store = of(conn)

            def same(before: bool) -> bool:
                reason = incarnation_gone(loop.run_until_complete(store.state(stream)), incarnation)
                if reason is None:
                    return True
                if on_recreated is None or not before:
                    raise BufferLost(stream, first, last, reason)
                on_recreated(reason)
                return False

            if not same(before=True):
                return
            agen = store.read_range(stream, first, last, on_gap=on_gap)
            try:
                while True:
                    try:
                        msgs = loop.run_until_complete(agen.__anext__())
                    except StopAsyncIteration:
                        break
                    yield msgs
            finally:
                loop.run_until_complete(agen.aclose())
            same(before=False)
        finally:
            loop.run_until_complete(conn.close())
    finally:
        close_loop(loop)


async def recreate_partitions(conn: Any, streams: list[str], *,
                              provision: Callable[[], Awaitable[Any]]) -> tuple[list[str], list[str]]:
    """Empty ``streams`` and give each a new incarnation, as recovery does to a region's partitions
    before it replays into them: a reader of the old incarnation sees loss, never the new frames
    under its old offsets. ``(removed, created)``. A store object (Redis) does it itself; on
    JetStream the streams are deleted and ``provision()`` (the pipeline's provisioning, which
    returns its report) makes them again with their configured limits."""
    if has_buffer_role(conn):
        for s in streams:
            await conn.buffer(s).delete()
            await conn.buffer(s).create()
        return list(streams), list(streams)
    js, removed = conn.jetstream(), []
    for s in streams:
        try:
            await js.delete_stream(s)
            removed.append(s)
        except Exception:  # noqa: BLE001 - missing already
            pass
    report = await provision()
    return removed, [r.name for r in report.resources if str(r.action) == "created"]
