"""The key-value role (:class:`isbflow.isb.store.KeyValue`) on Redis: one hash per bucket.

A bucket is the hash ``isbflow:kv:{<bucket>}`` (:func:`isbflow.isb.redis.keys.kv_key`; the bucket
name is the hash tag, so a Redis Cluster keeps a bucket in one slot), a key is one of its fields.
Each operation is one command, atomic on the server: ``HGET``, ``HSET`` (last writer wins),
``HDEL``, ``HKEYS`` and ``HINCRBY`` (concurrent adders never lose an addition, without the
compare-and-set retries JetStream needs). Buckets need no provisioning: a hash exists once it holds
a key, so :class:`isbflow.isb.store.BucketMissing` is never raised. Who may reach which bucket is
the ACL's (:mod:`isbflow.isb.redis.acl`).
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ResponseError

from isbflow.isb.redis.keys import kv_key
from isbflow.isb.store import ValueTooLarge

#: the largest value a put takes, in bytes: NATS's default ``max_payload`` (1 MiB) less the headroom
#: the JetStream store keeps for headers, so a value fits either store
MAX_VALUE = 1024 * 1024 - 1024


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RedisKeyValue:
    """One bucket on a ``redis.asyncio`` client, as a :class:`isbflow.isb.store.KeyValue` (module doc)."""

    def __init__(self, client: Any, bucket: str, *, max_value: int = MAX_VALUE):
        self.client, self.bucket, self.max_value = client, bucket, max_value
        self.key = kv_key(bucket)

    async def get(self, key: str) -> bytes | None:
        value = await self.client.hget(self.key, key)
        return None if value is None else bytes(value)

    async def put(self, key: str, value: bytes) -> None:
        if len(value) > self.max_value:
            raise ValueTooLarge(self.bucket, key, len(value), self.max_value)
        await self.client.hset(self.key, key, value)

    async def delete(self, key: str) -> None:
        await self.client.hdel(self.key, key)

    async def keys(self) -> list[str]:
        return sorted(_text(k) for k in await self.client.hkeys(self.key))

    async def items(self) -> dict[str, bytes]:
        """``HGETALL``: every key with its value, at one instant."""
        return {_text(k): bytes(v) for k, v in (await self.client.hgetall(self.key)).items()}

    async def add(self, key: str, n: int) -> int:
        """``HINCRBY``: atomic on the server. ``ValueError`` when the key holds no integer."""
        try:
            return int(await self.client.hincrby(self.key, key, n))
        except ResponseError as e:
            if "not an integer" not in str(e):
                raise
            raise ValueError(f"{self.bucket}/{key}: cannot add {n}: the key holds no integer") from None
