"""The Redis buffer partition on a real redis-server: idempotent writes, back-pressure, range reads
and releases that keep the stream and its dedup index bounded (isbflow.isb.redis.buffers)."""

from __future__ import annotations

import asyncio

import pytest

from isbflow.isb.errors import BufferLost
from isbflow.isb.redis.buffers import RedisBuffer, capacity
from isbflow.isb.redis.keys import BufferKeys
from isbflow.isb.store import BufferFull, BufferInfo, OutFrame, write_until_stored

STREAM = "isb-p-a-b-0"


def frames(n: int, start: int = 0, size: int = 64) -> list[OutFrame]:
    return [OutFrame(f"a:1:0:0:{i}:{i:016x}", i.to_bytes(4, "big") * (size // 4), 1) for i in range(start, start + n)]


async def _xlen(client, stream: str = STREAM) -> int:
    return await client.xlen(BufferKeys(stream).stream)


def test_a_second_write_of_the_same_frames_stores_them_once(redis_server):
    async def go():
        c = redis_server.client()
        b = RedisBuffer(c, STREAM)
        first = await b.write(frames(5))
        again = await b.write(frames(5))
        got = await b.read(None, None, 100)
        await c.aclose()
        return first, again, got

    first, again, got = asyncio.run(go())
    assert [w.duplicate for w in first] == [False] * 5
    assert [w.duplicate for w in again] == [True] * 5
    assert [f.frame_id for f in got] == [f.frame_id for f in frames(5)]
    assert [f.payload for f in got] == [f.payload for f in frames(5)]
    assert [f.offset for f in got] == [w.offset for w in first] == [1, 2, 3, 4, 5]


def test_a_fresh_writer_after_a_crash_between_write_and_commit_appends_nothing_twice(redis_server):
    """The first writer stores part of a batch and dies (its connection dropped, nothing committed
    upstream); the batch is re-executed by a new writer on a new connection, sending every frame."""
    async def go():
        crashed = redis_server.client()
        await RedisBuffer(crashed, STREAM).write(frames(7))
        await crashed.connection_pool.disconnect()  # gone without a goodbye
        fresh = redis_server.client()
        retry = await RedisBuffer(fresh, STREAM).write(frames(10))
        n = await _xlen(fresh)
        ids = [f.frame_id for f in await RedisBuffer(fresh, STREAM).read(None, None, 100)]
        await fresh.aclose()
        return retry, n, ids

    retry, n, ids = asyncio.run(go())
    assert [w.duplicate for w in retry] == [True] * 7 + [False] * 3
    assert n == 10
    assert ids == [f.frame_id for f in frames(10)]


def test_concurrent_writers_of_the_same_frame_ids_store_each_once(redis_server):
    """Eight writers on eight connections send the same 300 frames at once, each in its own order
    of calls: the server runs their checks and appends interleaved, and still stores each once."""
    batch = frames(300)

    async def writer(k: int) -> int:
        c = redis_server.client()
        b = RedisBuffer(c, STREAM)
        stored = 0
        chunks = [batch[i:i + 10] for i in range(0, len(batch), 10)]
        for chunk in chunks[k % 3:] + chunks[:k % 3]:  # the writers start at different frames
            stored += sum(not w.duplicate for w in await b.write(chunk))
        await c.aclose()
        return stored

    async def go():
        stored = await asyncio.gather(*(writer(k) for k in range(8)))
        c = redis_server.client()
        got = await RedisBuffer(c, STREAM).read(None, None, 10_000)
        await c.aclose()
        return stored, got

    stored, got = asyncio.run(go())
    assert sum(stored) == 300
    assert sorted(f.frame_id for f in got) == sorted(f.frame_id for f in batch)


def test_a_full_buffer_refuses_writes_until_a_release_makes_room(redis_server):
    async def go():
        c = redis_server.client()
        b = RedisBuffer(c, STREAM, capacity=capacity(10, 0.5))  # 5 entries
        batch = frames(8)
        with pytest.raises(BufferFull) as full:
            await b.write(batch)
        with pytest.raises(BufferFull) as still:
            await b.write(batch[5:])  # the caller's retry (retryUntilSuccess) while nothing was released
        stored = await b.read(None, None, 100)
        released = await b.release(stored[2].offset)
        rest = await b.write(batch[5:])
        got = await b.read(None, None, 100)
        await c.aclose()
        return full.value, still.value, released, rest, got

    full, still, released, rest, got = asyncio.run(go())
    assert (full.written, full.capacity, still.written) == (5, 5, 0)
    assert [w.frame_id for w in full.stored] == [f.frame_id for f in frames(5)]
    assert "is full" in str(full) and STREAM in str(full)
    assert released == 3
    assert [w.duplicate for w in rest] == [False] * 3
    assert [f.frame_id for f in got] == [f.frame_id for f in frames(8)[3:]]  # order kept across the refusal


def test_reads_return_exactly_the_range_and_the_same_frames_twice(redis_server):
    async def go():
        c = redis_server.client()
        b = RedisBuffer(c, STREAM)
        inc = await b.create()
        w = await b.write(frames(20))
        offs = [x.offset for x in w]
        mid = await b.read(offs[4], offs[9], 100, inc)
        capped = await b.read(offs[4], None, 3, inc)
        twice = await b.read(offs[4], offs[9], 100, inc)
        await c.aclose()
        return offs, mid, capped, twice

    offs, mid, capped, twice = asyncio.run(go())
    assert [f.offset for f in mid] == offs[5:10]
    assert [f.offset for f in capped] == offs[5:8]
    assert mid == twice
    assert offs == list(range(1, 21))


def test_a_read_of_another_incarnation_is_buffer_loss(redis_server):
    async def go():
        c = redis_server.client()
        b = RedisBuffer(c, STREAM)
        inc = await b.create()
        w = await b.write(frames(3))
        await b.delete()
        await b.write(frames(2, start=10))  # the writer makes a new incarnation
        try:
            await b.read(w[0].offset, None, 10, inc)
        finally:
            await c.aclose()

    with pytest.raises(BufferLost, match="recreated"):
        asyncio.run(go())


def test_releases_bound_both_the_stream_and_the_dedup_ids_on_a_long_run(redis_server):
    """10,000 frames written in batches of 100, each batch released once read (the downstream
    commit): the stream never holds more than a batch, the dedup index not much more (ids written
    in the release's own millisecond stay until the next release)."""
    async def go():
        c = redis_server.client()
        b = RedisBuffer(c, STREAM, capacity=200, dedup_window=0)
        inc = await b.create()
        peak_entries = peak_ids = 0
        last = None
        for k in range(100):
            await b.write(frames(100, start=100 * k, size=16))
            got = await b.read(last, None, 1000, inc)
            last = got[-1].offset
            s = await b.sizes()
            peak_entries, peak_ids = max(peak_entries, s.entries), max(peak_ids, s.ids)
            await b.release(last, inc)
        end = await b.sizes()
        st = await b.snapshot()
        await c.aclose()
        return peak_entries, peak_ids, end, st

    peak_entries, peak_ids, end, st = asyncio.run(go())
    assert st.entries_added == 10_000 and st.released == 10_000
    assert peak_entries == 100
    assert peak_ids <= 200
    assert end.entries == 0 and end.ids <= 100


def test_released_frames_still_deduplicate_within_the_window(redis_server):
    """A batch re-sent after its frames were released (a writer that crashed before its own commit
    while the downstream step was faster) is still recognised within the dedup window."""
    async def go():
        c = redis_server.client()
        b = RedisBuffer(c, STREAM, dedup_window=60)
        w = await b.write(frames(4))
        await b.release(w[-1].offset)
        again = await b.write(frames(4))
        n = await _xlen(c)
        await c.aclose()
        return again, n

    again, n = asyncio.run(go())
    assert [x.duplicate for x in again] == [True] * 4
    assert n == 0


def test_ids_of_released_frames_leave_the_index_after_the_window(redis_server):
    """The dedup index is bounded: once the window has passed, a release drops the released frames'
    ids, and the same frames written again are new entries (as after JetStream's window)."""
    async def go():
        c = redis_server.client()
        b = RedisBuffer(c, STREAM, dedup_window=0.2)
        w = await b.write(frames(4))
        await b.release(w[-1].offset)
        within = (await b.sizes()).ids
        await asyncio.sleep(0.3)
        await b.release(w[-1].offset)  # the next release, past the window
        after = (await b.sizes()).ids
        again = await b.write(frames(4))
        await c.aclose()
        return within, after, again

    within, after, again = asyncio.run(go())
    assert (within, after) == (4, 0)
    assert [x.duplicate for x in again] == [False] * 4 and [x.offset for x in again] == [5, 6, 7, 8]


def test_ids_of_unreleased_frames_stay_however_old(redis_server):
    """A release past the window drops only released frames' ids: a frame still in the stream,
    written long before (here: a window of 0), is still a duplicate. (Released ids written in the
    same millisecond as the first unreleased frame stay until a later release: here they are not.)"""
    async def go():
        c = redis_server.client()
        b = RedisBuffer(c, STREAM, dedup_window=0)
        await b.write(frames(2))
        await asyncio.sleep(0.01)
        await b.write(frames(5))
        await asyncio.sleep(0.01)
        await b.release(2)
        ids = (await b.sizes()).ids
        again = await b.write(frames(5))
        await c.aclose()
        return ids, again

    ids, again = asyncio.run(go())
    assert ids == 3
    assert [x.duplicate for x in again[2:]] == [True] * 3
    assert [(x.duplicate, x.offset) for x in again[:2]] == [(False, 6), (False, 7)]  # released, window past


def test_offsets_go_on_after_the_buffer_is_released_to_empty(redis_server):
    """The state in integer offsets, as JetStream's stream state: a buffer released to empty keeps
    its last offset (Redis keeps the empty stream's last id), so the next write is last + 1."""
    async def go():
        c = redis_server.client()
        b = RedisBuffer(c, STREAM)
        none = await b.state()
        inc = await b.create()
        created = await b.state()
        await b.write(frames(3))
        full = await b.state()
        await b.release(3, inc)
        empty = await b.state()
        more = await b.write(frames(2, start=10))
        later = await b.state()
        await c.aclose()
        return none, inc, created, full, empty, more, later

    none, inc, created, full, empty, more, later = asyncio.run(go())
    assert none is None
    assert created == BufferInfo(STREAM, inc, 1, 0, 0)
    assert full == BufferInfo(STREAM, inc, 1, 3, 3)
    assert empty == BufferInfo(STREAM, inc, 4, 3, 0)
    assert [w.offset for w in more] == [4, 5]
    assert later == BufferInfo(STREAM, inc, 4, 5, 2)


def test_capacity_follows_buffer_max_length_and_usage_limit():
    assert capacity(100, 0.8) == 80
    assert capacity(30_000, 0.8, frame_rows=10_000) == 3  # counted in frames as the JetStream writer does
    with pytest.raises(ValueError, match="bufferUsageLimit"):
        capacity(100, 1.5)


def test_a_server_that_forgot_the_scripts_still_takes_writes(redis_server):
    """EVALSHA answered NOSCRIPT (a restarted server, SCRIPT FLUSH) is sent again with EVAL."""
    async def go():
        c = redis_server.client()
        b = RedisBuffer(c, STREAM)
        await b.write(frames(2))
        await c.script_flush()
        written = await b.write(frames(3))
        await c.aclose()
        return written

    assert [w.duplicate for w in asyncio.run(go())] == [True, True, False]


def test_a_writer_held_by_a_full_buffer_goes_on_once_the_downstream_releases(redis_server):
    """onFull=retryUntilSuccess: the writer waits at capacity; a downstream reader that reads,
    commits and releases lets it go on, and every frame lands once, in order."""
    batch = frames(40)

    async def downstream(b: RedisBuffer, held: asyncio.Event, done: asyncio.Event) -> None:
        await held.wait()  # the writer met a full buffer
        last = None
        while not done.is_set() or await b.read(last, None, 1):
            got = await b.read(last, None, 100)
            if got:
                last = got[-1].offset
                await b.release(last)  # committed downstream
            await asyncio.sleep(0.01)

    async def go():
        c = redis_server.client()
        b = RedisBuffer(c, STREAM, capacity=5)
        held, done, refusals = asyncio.Event(), asyncio.Event(), []

        def on_full(full: BufferFull) -> None:
            refusals.append(full.written)
            held.set()

        reader = asyncio.create_task(downstream(RedisBuffer(c, STREAM), held, done))
        written = await write_until_stored(b, batch, first_pause=0.01, max_pause=0.05, on_full=on_full)
        done.set()
        await reader
        st = await b.snapshot()
        await c.aclose()
        return written, refusals, st

    written, refusals, st = asyncio.run(go())
    assert refusals and refusals[0] == 5
    assert [w.frame_id for w in written] == [f.frame_id for f in batch]
    assert not any(w.duplicate for w in written)
    assert st.entries_added == 40 and st.length == 0



def test_a_full_dead_letter_stream_refuses_the_next_letter(redis_server):
    """A pipeline's dead letters are bounded: a full stream refuses the next letter (the step fails
    loudly) and keeps every letter it took."""
    from isbflow.isb.redis.dead_letters import RedisDeadLetters
    from isbflow.isb.store import BufferFull

    async def go():
        c = redis_server.client()
        try:
            dl = RedisDeadLetters(c, capacity=3)
            stored = await dl.publish("isb-p-dlq", [(f"l{i}", b'{"step":"s"}') for i in range(3)])
            with pytest.raises(BufferFull):
                await dl.publish("isb-p-dlq", [("l3", b'{"step":"s"}')])
            return stored, len(await dl.read("isb-p-dlq"))
        finally:
            await c.aclose()

    assert asyncio.run(go()) == (3, 3)
