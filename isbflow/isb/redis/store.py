"""The Redis store as one object: its key-value buckets and its buffer partitions on one client.

:class:`RedisStore` is the :class:`isbflow.isb.store.ControlStore` of Redis: callers holding it get
a bucket with ``await store.kv(bucket)`` (:func:`isbflow.isb.control.kv` takes it as it takes a NATS
connection) and a partition with ``store.buffer(stream)``. :meth:`RedisStore.open` connects to the
embedded redis-server under a data dir as a role user (:mod:`isbflow.isb.redis.client`), whose ACL
decides which buckets and streams it reaches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from isbflow.isb.redis.acl import ADMIN
from isbflow.isb.redis.buffers import RedisBuffer
from isbflow.isb.redis.client import connect
from isbflow.isb.redis.dead_letters import RedisDeadLetters
from isbflow.isb.redis.kv import RedisKeyValue
from isbflow.isb.redis.partitions import RedisBuffers


class RedisStore:
    """Buckets and buffers on one ``redis.asyncio`` client (module doc); closes the client with
    :meth:`aclose` (or ``async with``)."""

    def __init__(self, client: Any):
        self.client = client
        self._buckets: dict[str, RedisKeyValue] = {}
        self._closed = False

    @classmethod
    def open(cls, data_dir: Path | str, user: str = ADMIN) -> RedisStore:
        """The store of the embedded redis-server under ``data_dir``, as ``user`` (the admin by
        default); :class:`isbflow.isb.redis.server.EmbeddedRedisError` when none is recorded there
        or the user has no password yet."""
        return cls(connect(data_dir, user))

    async def kv(self, bucket: str) -> RedisKeyValue:
        """Bucket ``bucket`` (made on its first put: never :class:`isbflow.isb.store.BucketMissing`)."""
        if bucket not in self._buckets:
            self._buckets[bucket] = RedisKeyValue(self.client, bucket)
        return self._buckets[bucket]

    def buffer(self, stream: str, **kw: Any) -> RedisBuffer:
        """Partition ``stream``; ``kw`` as :class:`isbflow.isb.redis.buffers.RedisBuffer` takes them
        (``capacity``, ``dedup_window``, ``create_missing``)."""
        return RedisBuffer(self.client, stream, **kw)

    def dead_letters(self) -> RedisDeadLetters:
        """The dead-letter role (:mod:`isbflow.isb.dlq` calls it on a store object)."""
        return RedisDeadLetters(self.client)

    def buffers(self) -> RedisBuffers:
        """The buffer role of :mod:`isbflow.isb.buffers` on this store (state, range reads, waits, release)."""
        return RedisBuffers(self.client)

    async def aclose(self) -> None:
        self._closed = True
        await self.client.aclose()

    async def close(self) -> None:
        """:meth:`aclose`, under the name the sessions of :mod:`isbflow.isb.connect` call on any connection."""
        await self.aclose()

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def is_connected(self) -> bool:
        """Open (what :func:`isbflow.isb.connect.run_kept` asks of a kept connection before using it):
        the client's pool connects again on the next command after a dropped connection."""
        return not self._closed

    async def __aenter__(self) -> RedisStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
