"""The key-value role's contract (isbflow.isb.store.KeyValue), one set of behaviour tests run
against every store: JetStream's KV buckets on a real nats-server (isbflow.isb.jetstream.kv) and
Redis hashes on a real redis-server (isbflow.isb.redis.kv). The layers above (the ledger, the
status and control buckets, the dead-letter counters) are written once against the role, so a
store that differs here differs everywhere. A machine without either server fails, never skips."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from nats.js.api import KeyValueConfig

from isbflow.isb.connect import session
from isbflow.isb.jetstream import kv as jetstream_kv
from isbflow.isb.redis.store import RedisStore
from isbflow.isb.store import KeyValue, ValueTooLarge
from tests.helpers.redis_server import running_redis

_names = itertools.count()


@pytest.fixture(scope="module")
def redis_store():
    with running_redis() as r:
        yield r


@pytest.fixture(params=["jetstream", "redis"])
def open_bucket(request):
    """An async context manager giving a fresh, empty bucket of the store under test."""
    if request.param == "jetstream":
        settings = request.getfixturevalue("nats_server").settings

        @asynccontextmanager
        async def jetstream() -> AsyncIterator[KeyValue]:
            async with session(settings, name="t-kv-contract") as nc:
                name = f"contract-{next(_names)}"
                await nc.jetstream().create_key_value(KeyValueConfig(bucket=name, history=1))
                yield await jetstream_kv.bucket(nc, name)

        return jetstream
    data_dir = request.getfixturevalue("redis_store").data_dir

    @asynccontextmanager
    async def redis() -> AsyncIterator[KeyValue]:
        async with RedisStore.open(data_dir) as store:
            yield await store.kv(f"contract-{next(_names)}")

    return redis


def run(open_bucket, body: Callable[[KeyValue], Awaitable]):
    async def go():
        async with open_bucket() as kv:
            return await body(kv)

    return asyncio.run(go())


def test_a_missing_key_reads_as_none(open_bucket):
    async def body(kv: KeyValue):
        return await kv.get("never.put"), await kv.keys()

    assert run(open_bucket, body) == (None, [])


def test_a_put_reads_back_and_a_second_put_overwrites(open_bucket):
    async def body(kv: KeyValue):
        await kv.put("step.a", b"running")
        first = await kv.get("step.a")
        await kv.put("step.a", b"draining")
        return first, await kv.get("step.a"), await kv.keys()

    assert run(open_bucket, body) == (b"running", b"draining", ["step.a"])


async def _put_two_delete_two(kv: KeyValue):
    await kv.put("step.a", b"1")
    await kv.put("step.b", b"2")
    await kv.delete("step.a")
    await kv.delete("never.put")  # nothing to delete: fine
    return await kv.get("step.a"), await kv.get("never.put"), await kv.get("step.b"), await kv.keys()


def test_a_deleted_key_reads_as_none(open_bucket):
    assert run(open_bucket, _put_two_delete_two)[:3] == (None, None, b"2")


def test_a_deleted_key_is_not_listed(open_bucket):
    assert run(open_bucket, _put_two_delete_two)[3] == ["step.b"]


def test_items_hold_every_live_key_with_its_value(open_bucket):
    async def body(kv: KeyValue):
        await _put_two_delete_two(kv)
        await kv.put("step.c", b"3")
        return await kv.items()

    assert run(open_bucket, body) == {"step.b": b"2", "step.c": b"3"}


def test_keys_come_sorted(open_bucket):
    names = ["sink.z", "a.b", "step.m.0", "step.m.10", "A.c"]

    async def body(kv: KeyValue):
        for k in names:
            await kv.put(k, b"x")
        return await kv.keys()

    assert run(open_bucket, body) == sorted(names)


def test_add_starts_from_zero_and_accumulates(open_bucket):
    async def body(kv: KeyValue):
        first = await kv.add("dlq.count", 3)
        second = await kv.add("dlq.count", 4)
        return first, second, await kv.get("dlq.count")

    assert run(open_bucket, body) == (3, 7, b"7")


def test_concurrent_adds_lose_nothing(open_bucket):
    async def body(kv: KeyValue):
        results = await asyncio.gather(*(kv.add("dlq.count", 1) for _ in range(20)))
        return sorted(results), await kv.get("dlq.count")

    results, total = run(open_bucket, body)
    assert results == list(range(1, 21)) and total == b"20"


def test_a_value_over_the_limit_is_refused_naming_the_key(open_bucket):
    async def body(kv: KeyValue):
        await kv.put("ledger.s", b"x" * kv.max_value)  # at the limit: taken
        with pytest.raises(ValueTooLarge) as e:
            await kv.put("ledger.s", b"x" * (kv.max_value + 1))
        return e.value, len(await kv.get("ledger.s") or b"")

    too_large, kept = run(open_bucket, body)
    assert "ledger.s" in str(too_large) and too_large.key == "ledger.s"
    assert too_large.size == too_large.limit + 1
    assert kept == too_large.limit
