"""The key-value buckets of a connection, whichever store it is.

Every caller holds a *connection*: a nats-py client (the JetStream store) or a store object with
its own :meth:`isbflow.isb.store.ControlStore.kv` (the Redis store,
:class:`isbflow.isb.redis.store.RedisStore`). :func:`kv` gives the bucket as a
:class:`isbflow.isb.store.KeyValue` either way, so the ledger, the status and control
buckets and the dead-letter counters are written once, for every store.
"""

from __future__ import annotations

from typing import Any

from isbflow.isb.jetstream import kv as jetstream_kv
from isbflow.isb.store import KeyValue


async def kv(conn: Any, bucket: str) -> KeyValue:
    """Bucket ``bucket`` of ``conn``; :class:`isbflow.isb.store.BucketMissing` when the store
    needs it provisioned and it was not."""
    own = getattr(conn, "kv", None)
    if own is not None and callable(own):
        return await own(bucket)
    return await jetstream_kv.bucket(conn, bucket)
