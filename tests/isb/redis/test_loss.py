"""Loss detection on a real redis-server (isbflow.isb.redis.loss): a flushed, restarted-without-
persistence, trimmed or failed-over buffer is buffer loss, never an empty buffer; a restart with
persistence and a release are not loss."""

from __future__ import annotations

import asyncio

import pytest

from isbflow.isb.errors import BufferLost
from isbflow.isb.redis.buffers import RedisBuffer
from isbflow.isb.redis.keys import BufferKeys, offset_of
from isbflow.isb.redis.loss import BufferState, judge
from isbflow.isb.store import Incarnation, OutFrame, ReaderPosition
from tests.helpers.redis_server import RedisHandle, running_redis

STREAM = "isb-p-a-b-0"


def frames(n: int, start: int = 0) -> list[OutFrame]:
    return [OutFrame(f"a:1:0:0:{i}:{i:016x}", bytes([i % 256]) * 32, 1) for i in range(start, start + n)]


async def _write_and_read(r: RedisHandle, n: int = 6, read: int = 3) -> tuple[str, int]:
    """Write ``n`` frames into a created buffer, read ``read`` of them: the reader's incarnation and offset."""
    c = r.client()
    b = RedisBuffer(c, STREAM)
    inc = await b.create()
    await b.write(frames(n))
    got = await b.read(None, None, read, inc)
    await c.aclose()
    return inc, got[-1].offset


async def _check(r: RedisHandle, inc: str, read_to: int | None):
    c = r.client()
    loss = await RedisBuffer(c, STREAM).check(ReaderPosition(inc, read_to))
    await c.aclose()
    return loss


def test_flushall_is_buffer_loss_and_a_later_write_a_new_incarnation():
    with running_redis() as r:
        inc, read_to = asyncio.run(_write_and_read(r))

        async def go():
            c = r.client()
            b = RedisBuffer(c, STREAM)
            await c.flushall()
            gone = await b.check(ReaderPosition(inc, read_to))
            with pytest.raises(BufferLost, match="incarnation is gone"):
                await b.read(read_to, None, 10, inc)
            await b.write(frames(2, start=100))  # the upstream step goes on writing
            recreated = await b.check(ReaderPosition(inc, read_to))
            await c.aclose()
            return gone, recreated

        gone, recreated = asyncio.run(go())
    assert read_to == 3
    assert gone is not None and "flushed" in gone.reason and gone.first == 4
    assert recreated is not None and "recreated" in recreated.reason


def test_a_restart_without_persistence_is_buffer_loss():
    with running_redis(persistence="none") as r:
        inc, read_to = asyncio.run(_write_and_read(r))
        assert asyncio.run(_check(r, inc, read_to)) is None
        r.restart()
        loss = asyncio.run(_check(r, inc, read_to))
    assert loss is not None and "incarnation is gone" in loss.reason


def test_a_restart_with_persistence_keeps_the_buffer_and_its_dedup_ids():
    with running_redis(persistence="aof") as r:
        inc, read_to = asyncio.run(_write_and_read(r))
        r.restart()

        async def go():
            c = r.client()
            b = RedisBuffer(c, STREAM)
            loss = await b.check(ReaderPosition(inc, read_to))
            rest = await b.read(read_to, None, 10, inc)
            again = await b.write(frames(6))
            await c.aclose()
            return loss, rest, again

        loss, rest, again = asyncio.run(go())
    assert loss is None
    assert [f.frame_id for f in rest] == [f.frame_id for f in frames(6)[3:]]
    assert all(w.duplicate for w in again)


def test_a_release_is_not_loss_but_a_trim_outside_isbflow_is():
    with running_redis() as r:
        inc, read_to = asyncio.run(_write_and_read(r))

        async def go():
            c = r.client()
            b = RedisBuffer(c, STREAM)
            await b.release(read_to, inc)  # the downstream committed what was read
            after_release = await b.check(ReaderPosition(inc, read_to))
            await c.xtrim(BufferKeys(STREAM).stream, maxlen=1, approximate=False)  # someone trims 2 unread
            after_trim = await b.check(ReaderPosition(inc, read_to))
            await c.aclose()
            return after_release, after_trim

        after_release, after_trim = asyncio.run(go())
    assert after_release is None
    assert after_trim is not None and "2 entries were removed that no release freed" in after_trim.reason
    assert after_trim.first == read_to + 1 == 4


def test_a_buffer_behind_what_was_read_is_loss():
    """What a failover to a replica that missed the master's last writes leaves: the same
    incarnation, but a stream whose last id is below what the reader already read."""
    with running_redis() as r:
        inc, read_to = asyncio.run(_write_and_read(r, n=6, read=5))

        async def go():
            c = r.client()
            keys = BufferKeys(STREAM)
            entries = await c.xrange(keys.stream, count=2)
            await c.delete(keys.stream)
            for entry_id, fields in entries:  # the replica had received only the first two entries
                await c.xadd(keys.stream, fields, id=entry_id)
            loss = await RedisBuffer(c, STREAM).check(ReaderPosition(inc, read_to))
            await c.aclose()
            return loss, offset_of(entries[-1][0])

        loss, last = asyncio.run(go())
    assert loss is not None and "holds less than was read" in loss.reason
    assert last == 2 and loss.first == 3


def _state(**kw) -> BufferState:
    base = dict(incarnation=Incarnation("i1", 0.0), released=0, released_to=0, length=0,
                entries_added=0, first=None, last_generated=0, ids=0)
    return BufferState(**{**base, **kw})


def test_judge_tells_an_empty_buffer_from_a_lost_one():
    """The rules alone, on states a server would report (the tests above reach each on a real server)."""
    seen = ReaderPosition("i1", 5)
    # empty because everything read was released: not loss
    assert judge("s", _state(entries_added=5, released=5, released_to=5, last_generated=5), seen) is None
    # a reader that has read nothing yet, on a new buffer
    assert judge("s", _state(), ReaderPosition("i1", None)) is None
    assert "incarnation is gone" in judge("s", _state(incarnation=None), seen).reason
    assert "recreated" in judge("s", _state(incarnation=Incarnation("i2", 1.0)), seen).reason
    assert "holds less" in judge("s", _state(entries_added=3, length=3, first=1, last_generated=3), seen).reason
    # trimmed outside isbflow past the reader (2 released, 3 removed unreleased): the loss starts after both
    trimmed = judge("s", _state(entries_added=9, released=2, released_to=2, length=4, first=6, last_generated=9),
                    ReaderPosition("i1", 1))
    assert trimmed is not None and trimmed.first == 3


def test_a_failover_to_a_replica_behind_its_master_is_loss_for_a_reader_past_it():
    """A real replica: it follows the master, is cut off, the master takes three more frames and
    the reader reads them; then the replica is promoted. A reader that had read past what the
    replica holds finds the loss; one that had not cannot (the buffer never held those frames, as
    far as the replica knows): the replay from the source's offsets covers that case."""
    with running_redis() as master, running_redis() as replica:
        async def go():
            m, rep = master.client(), replica.client()
            await m.config_set("repl-diskless-sync-delay", 0)  # send the first sync at once, not after 5 s
            await rep.config_set("masterauth", master.state.password)
            await rep.execute_command("REPLICAOF", "127.0.0.1", str(master.state.port))
            b = RedisBuffer(m, STREAM)
            inc = await b.create()
            early = await b.write(frames(3))
            while await m.execute_command("WAIT", 1, 1000) < 1:  # the replica has the first three
                pass
            await rep.execute_command("REPLICAOF", "NO", "ONE")  # cut off, then promoted
            late = await b.write(frames(3, start=3))
            promoted = RedisBuffer(rep, STREAM)
            past = await promoted.check(ReaderPosition(inc, late[-1].offset))
            within = await promoted.check(ReaderPosition(inc, early[1].offset))
            await m.aclose()
            await rep.aclose()
            return early, past, within

        early, past, within = asyncio.run(go())
    assert past is not None and "holds less than was read" in past.reason
    assert early[-1].offset == 3 and past.first == 4
    assert within is None
