"""The key-value role (:class:`isbflow.isb.store.KeyValue`) on JetStream's KV buckets.

A bucket is a KV stream ``KV_<bucket>`` made when the pipeline's ISB service is provisioned
(:mod:`isbflow.isb.provision`); this module only opens it. Keys are listed from the stream's
subjects (``STREAM.INFO`` with a subjects filter), not with nats-py's ``KeyValue.keys()``: that
lists through an ordered watcher that stops at the first delivery reporting nothing pending, and
it has come back short (a ledger read without a sink whose four commits had each recorded their
offsets). A deleted key keeps a marker on its subject; :meth:`JetStreamKeyValue.keys` leaves it out.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from nats.errors import MaxPayloadError
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)

from isbflow.isb.store import BucketMissing, ValueTooLarge

#: bytes a put keeps free of ``max_payload`` for the message's headers
PUT_HEADROOM = 1024
#: per connection, the buckets opened so far: opening asks the server for the bucket's stream (a
#: round trip), and a runner's loop reads or writes these buckets for every step on each heartbeat;
#: a handle is only the stream's name and options, good for the connection's life
_handles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class JetStreamKeyValue:
    """One JetStream KV bucket as a :class:`isbflow.isb.store.KeyValue`."""

    def __init__(self, nc: Any, bucket: str, kv: Any):
        self.nc, self.bucket, self._kv = nc, bucket, kv
        self.max_value = max(1, (nc.max_payload or 1024 * 1024) - PUT_HEADROOM)

    async def get(self, key: str) -> bytes | None:
        try:
            entry = await self._kv.get(key)
        except (KeyNotFoundError, KeyDeletedError, NotFoundError):
            return None
        return entry.value

    async def put(self, key: str, value: bytes) -> None:
        if len(value) > self.max_value:
            raise ValueTooLarge(self.bucket, key, len(value), self.max_value)
        try:
            await self._kv.put(key, value)
        except MaxPayloadError:
            raise ValueTooLarge(self.bucket, key, len(value), self.max_value) from None

    async def delete(self, key: str) -> None:
        try:
            await self._kv.delete(key)
        except (KeyNotFoundError, NotFoundError):
            pass

    async def purge(self, key: str) -> None:
        """Remove the key and its history (JetStream keeps a delete marker otherwise)."""
        try:
            await self._kv.purge(key)
        except (KeyNotFoundError, NotFoundError):
            pass

    async def keys(self) -> list[str]:
        prefix = f"$KV.{self.bucket}."
        try:
            info = await self.nc.jetstream().stream_info(f"KV_{self.bucket}", subjects_filter=prefix + ">")
        except NotFoundError:
            raise BucketMissing(self.bucket) from None
        # a deleted or purged key keeps a marker on its subject: only keys whose last message is a value
        listed = sorted(s[len(prefix):] for s in (info.state.subjects or {}))
        held = await asyncio.gather(*(self.get(k) for k in listed))
        return [k for k, v in zip(listed, held, strict=True) if v is not None]

    async def items(self) -> dict[str, bytes]:
        listed = await self.keys()
        held = await asyncio.gather(*(self.get(k) for k in listed))
        return {k: v for k, v in zip(listed, held, strict=True) if v is not None}

    async def add(self, key: str, n: int) -> int:
        """Compare-and-set on the key's revision, again while another adder got in between."""
        for _ in range(100):
            try:
                entry = await self._kv.get(key)
            except (KeyNotFoundError, KeyDeletedError, NotFoundError):  # missing or deleted
                entry = None
            try:
                if entry is None:
                    await self._kv.create(key, str(n).encode())
                    return n
                total = int(entry.value or 0) + n
                await self._kv.update(key, str(total).encode(), last=entry.revision)
                return total
            except KeyWrongLastSequenceError:
                await asyncio.sleep(0.01)
        raise TimeoutError(f"{self.bucket}/{key}: could not add {n}: the key kept changing")


async def bucket(nc: Any, name: str) -> JetStreamKeyValue:
    """KV bucket ``name`` on connection ``nc``; :class:`BucketMissing` when it was never made."""
    handles = _handles.setdefault(nc, {})
    if name not in handles:
        try:
            kv = await nc.jetstream().key_value(name)
        except (BucketNotFoundError, NotFoundError):
            raise BucketMissing(name) from None
        handles[name] = JetStreamKeyValue(nc, name, kv)
    return handles[name]
