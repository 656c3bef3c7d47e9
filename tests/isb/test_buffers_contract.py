"""The buffer role's contract (isbflow.isb.buffers), one set of behaviour tests run against every
store through the connection the layers above hold: a nats-py client on a real nats-server
(JetStream streams) and a RedisStore on a real redis-server (Redis streams), both opened by
isbflow.isb.connect.connect from their settings. The steps, recovery and the faces read buffer
state, ranges and waits and release through this role only, so a store that differs here differs
everywhere. A machine without either server fails, never skips."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from nats.js.api import RePublish, RetentionPolicy, StreamConfig

from isbflow.isb import buffers, dlq, naming
from isbflow.isb.connect import IsbUnreachable, RedisSettings, connect
from isbflow.isb.errors import BufferLost
from isbflow.isb.frames import FRAME_FORMAT, HDR_FRAME, HDR_ROWS
from isbflow.isb.redis.server import read_state
from isbflow.isb.store import OutFrame
from tests.helpers.redis_server import running_redis

_names = itertools.count()


@pytest.fixture(scope="module")
def redis_store():
    with running_redis() as r:
        yield r


def _redis_settings(handle, password: str | None = None) -> RedisSettings:
    state = read_state(handle.data_dir)
    assert state is not None
    pw = password if password is not None else (handle.data_dir / "redis" / "password").read_text().strip()
    return RedisSettings(url=f"redis://127.0.0.1:{state.port}/0", password=pw)


@dataclass
class Store:
    """An open connection of one store and how a test appends frames to one of its partitions."""

    conn: Any
    append: Callable[[str, list[bytes]], Awaitable[None]]
    settings: Any
    #: makes pipeline's dead-letter buffer where the store needs it made (JetStream's stream)
    prepare_dlq: Callable[[str], Awaitable[None]] = None  # type: ignore[assignment]


@pytest.fixture(params=["jetstream", "redis"])
def open_store(request):
    """An async context manager giving (connection, a fresh partition's name, an appender)."""
    if request.param == "jetstream":
        settings = request.getfixturevalue("nats_server").settings

        @asynccontextmanager
        async def jetstream() -> AsyncIterator[tuple[Store, str]]:
            nc = await connect(settings, name="t-buffers-contract")
            name = f"bc-{next(_names)}"
            subject = f"bc.{name}"
            js = nc.jetstream()
            await js.add_stream(StreamConfig(
                name=name, subjects=[subject], retention=RetentionPolicy.WORK_QUEUE, allow_direct=True,
                republish=RePublish(src=">", dest=naming.wake_subject(name), headers_only=True)))
            counter = itertools.count()

            async def append(stream: str, payloads: list[bytes]) -> None:
                for p in payloads:
                    await js.publish(subject, p, headers={
                        "Nats-Msg-Id": f"{stream}:{next(counter)}", HDR_FRAME: FRAME_FORMAT, HDR_ROWS: "1"})

            async def prepare_dlq(pipeline: str) -> None:
                await js.add_stream(StreamConfig(name=naming.dlq_stream(pipeline), subjects=[f"isb.{pipeline}.dlq.>"]))

            try:
                yield Store(nc, append, settings, prepare_dlq), name
            finally:
                await nc.close()

        return jetstream
    handle = request.getfixturevalue("redis_store")

    @asynccontextmanager
    async def redis() -> AsyncIterator[tuple[Store, str]]:
        settings = _redis_settings(handle)
        store = await connect(settings, name="t-buffers-contract")
        name = f"bc-{next(_names)}"
        counter = itertools.count()

        async def append(stream: str, payloads: list[bytes]) -> None:
            await store.buffer(stream).write([OutFrame(f"{stream}:{next(counter)}", p, 1) for p in payloads])

        async def prepare_dlq(pipeline: str) -> None:
            return None

        try:
            yield Store(store, append, settings, prepare_dlq), name
        finally:
            await store.close()

    return redis


def run(open_store, body: Callable[[Store, str], Awaitable]):
    async def go():
        async with open_store() as (store, stream):
            return await body(store, stream)

    return asyncio.run(go())


PAYLOADS = [f"frame-{i}".encode() for i in range(1, 6)]


def test_state_counts_offsets_from_one_and_a_missing_partition_is_none(open_store):
    async def body(s: Store, stream: str):
        await s.append(stream, PAYLOADS)
        return await buffers.stream_state(s.conn, stream), await buffers.stream_state(s.conn, stream + "-none")

    st, missing = run(open_store, body)
    assert (st.first_seq, st.last_seq, st.messages) == (1, 5, 5)
    assert st.incarnation and missing is None


def test_a_range_reads_exactly_its_offsets_in_order_and_removes_nothing(open_store):
    async def body(s: Store, stream: str):
        await s.append(stream, PAYLOADS)
        first = [m for chunk in [c async for c in buffers.read_range(s.conn, stream, 2, 4)] for m in chunk]
        again = [m for chunk in [c async for c in buffers.read_range(s.conn, stream, 2, 4)] for m in chunk]
        return first, again, await buffers.stream_state(s.conn, stream)

    first, again, st = run(open_store, body)
    assert [m[0] for m in first] == [2, 3, 4]
    assert [m[1] for m in first] == PAYLOADS[1:4]
    assert all(m[2][HDR_FRAME] == FRAME_FORMAT and m[2][HDR_ROWS] == "1" for m in first)
    assert all(isinstance(m[3], int) and m[3] > 1_700_000_000 * 10**9 or isinstance(m[3], str) for m in first)
    assert [m[:2] for m in again] == [m[:2] for m in first]
    assert st.messages == 5


def test_release_frees_up_to_an_offset_and_a_released_range_is_a_gap(open_store):
    async def body(s: Store, stream: str):
        await s.append(stream, PAYLOADS)
        st = await buffers.stream_state(s.conn, stream)
        wrong = await buffers.release(s.conn, stream, 5, "WorkQueue", incarnation="another-life")
        kept = await buffers.release(s.conn, stream, 5, "Limits", incarnation=st.incarnation)
        freed = await buffers.release(s.conn, stream, 3, "WorkQueue", incarnation=st.incarnation)
        after = await buffers.stream_state(s.conn, stream)
        gaps: list[tuple[int, int]] = []
        skipped = [m[0] async for chunk in buffers.read_range(s.conn, stream, 1, 5, on_gap=lambda a, b: gaps.append((a, b)))
                   for m in chunk]
        with pytest.raises(BufferLost) as lost:
            async for _ in buffers.read_range(s.conn, stream, 1, 5):
                pass
        return wrong, kept, freed, after, gaps, skipped, lost.value

    wrong, kept, freed, after, gaps, skipped, lost = run(open_store, body)
    assert (wrong, kept, freed) == (0, 0, 3)
    assert (after.first_seq, after.last_seq, after.messages) == (4, 5, 2)
    assert gaps == [(1, 3)] and skipped == [4, 5]
    assert (lost.lost_first, lost.lost_last) == (1, 3) and "before they were read" in str(lost)


def test_a_wait_ends_on_an_append_on_its_timeout_or_when_told(open_store):
    async def body(s: Store, stream: str):
        await s.append(stream, PAYLOADS[:1])

        async def later():
            await asyncio.sleep(0.5)
            await s.append(stream, PAYLOADS[1:2])

        task = asyncio.create_task(later())
        woke = await buffers.wait_for_append(s.conn, {stream: 1}, timeout=30)
        await task
        early = await buffers.wait_for_append(s.conn, {stream: 1}, timeout=30)  # appended before the wait
        idle = await buffers.wait_for_append(s.conn, {stream: 2}, timeout=0.8)
        told = await buffers.wait_for_append(s.conn, {stream: 2}, timeout=30, cancelled=lambda: True)
        return woke, early, idle, told

    assert run(open_store, body) == (True, True, False, False)


def test_a_task_reads_its_partition_checking_the_incarnation_before_and_after(open_store):
    async def body(s: Store, stream: str):
        await s.append(stream, PAYLOADS)
        return (await buffers.stream_state(s.conn, stream)).incarnation, s.settings, stream

    inc, settings, stream = run(open_store, body)
    # a task runs outside any event loop, with its own connection
    got = [m[0] for chunk in buffers.read_partition(settings, stream, inc, 2, 5) for m in chunk]
    told: list[str] = []
    skipped = list(buffers.read_partition(settings, stream, "another-life", 1, 5, on_recreated=told.append))
    with pytest.raises(BufferLost) as lost:
        list(buffers.read_partition(settings, stream, "another-life", 1, 5))
    assert got == [2, 3, 4, 5]
    assert skipped == [] and len(told) == 1 and "recreated" in told[0]
    assert "recreated" in str(lost.value)


def test_dead_letters_are_stored_once_read_back_per_step_and_give_their_origins(open_store):
    pipeline = f"dl{next(_names)}"

    async def body(s: Store, stream: str):
        await s.prepare_dlq(pipeline)
        target = dlq.dead_letter_target(s.conn)
        letters = [dlq.DeadLetter(record={"_isb_id": "in/0/7", "n": 1}, reason="bad n", msg_id="parse:1:0:dlq:0"),
                   dlq.DeadLetter(record={"n": 2}, reason="too big")]
        first = await dlq.publish_dead_letters(target, pipeline, "parse", letters)
        again = await dlq.publish_dead_letters(target, pipeline, "parse", letters[:1])  # a re-executed batch
        other = await dlq.publish_dead_letters(target, pipeline, "enrich", [{"_isb_id": "in/0/9"}], reason="r")
        return first, again, other, await dlq.dead_letter_origins(s.conn, pipeline), s.settings

    first, again, other, origins, settings = run(open_store, body)
    parse = asyncio.run(dlq.read_dead_letters(settings, pipeline, "parse"))
    everything = asyncio.run(dlq.read_dead_letters(settings, pipeline))
    assert (first, again, other) == (2, 0, 1)
    assert [(d["reason"], d["origin"], d["record"]) for d in parse] == [
        ("bad n", "in/0/7", {"_isb_id": "in/0/7", "n": 1}),
        ("too big", "", {"n": 2})]
    assert [d["step"] for d in everything] == ["parse", "parse", "enrich"]
    assert [d["seq"] for d in everything] == sorted(d["seq"] for d in everything)
    assert all(d["subject"] == naming.dlq_subject(pipeline, d["step"]) for d in everything)
    assert origins == ["in/0/7", "in/0/9"]


def test_a_wrong_password_is_refused_naming_the_url_not_the_password(redis_store):
    settings = _redis_settings(redis_store, password="not-the-password")

    async def go():
        await connect(settings, name="t-refused")

    with pytest.raises(IsbUnreachable) as e:
        asyncio.run(go())
    assert settings.display in str(e.value) and "refused" in str(e.value)
    assert "not-the-password" not in str(e.value)
