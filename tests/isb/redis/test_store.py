"""The Redis store object (isbflow.isb.redis.store): its buckets and buffers on one client, and as
a ControlStore to the callers that take any store's connection (isbflow.isb.control.kv)."""

from __future__ import annotations

import asyncio

import pytest

from isbflow.isb import control
from isbflow.isb.redis.kv import MAX_VALUE, RedisKeyValue
from isbflow.isb.redis.server import EmbeddedRedisError
from isbflow.isb.redis.store import RedisStore
from isbflow.isb.store import OutFrame


def test_a_store_gives_its_buckets_and_buffers(redis_server):
    async def go():
        async with RedisStore.open(redis_server.data_dir) as store:
            kv = await store.kv("isbflow-p-status")
            same = await store.kv("isbflow-p-status")
            through_control = await control.kv(store, "isbflow-p-status")
            await kv.put("step.a", b"up")
            written = await store.buffer("isb-p-a-b-0", capacity=10).write([OutFrame("f:0", b"frame", 1)])
            await kv.put("n", b"not a number")
            with pytest.raises(ValueError, match="isbflow-p-status/n: cannot add 1"):
                await kv.add("n", 1)
            return kv, same, through_control, await through_control.get("step.a"), written

    kv, same, through_control, got, written = asyncio.run(go())
    assert isinstance(kv, RedisKeyValue) and same is kv and through_control is kv
    assert kv.max_value == MAX_VALUE == 1024 * 1024 - 1024
    assert got == b"up" and [w.offset for w in written] == [1]


def test_opening_a_store_where_no_server_runs_says_so(tmp_path):
    with pytest.raises(EmbeddedRedisError, match="no redis-server is recorded"):
        RedisStore.open(tmp_path)
