"""Per-role ACL users on a real redis-server (isbflow.isb.redis.acl): each role reaches its own
streams with its own commands, and nothing else."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest
from redis.exceptions import ResponseError

from isbflow.isb import naming, roles
from isbflow.isb.redis import acl
from isbflow.isb.redis.buffers import RedisBuffer
from isbflow.isb.redis.keys import BufferKeys, kv_key
from isbflow.isb.redis.store import RedisStore
from isbflow.isb.store import OutFrame
from tests.helpers.redis_server import running_redis

# "p" and "p-x": a key pattern by prefix (isb-p-*) would give p's user p-x's streams too
P = roles.PipelineGrant("p", ("isb-p-a-b-0", "isb-p-a-b-1"), ("src-p-in",), ("in.p",), "isb-p-dlq", (),
                       (naming.reference_bucket("p", "t"),))
PX = roles.PipelineGrant("p-x", ("isb-p-x-a-b-0",), ("src-p-x-in",), ("in.px",), "isb-p-x-dlq", (), ())
FRAME = [OutFrame("s:1:0:0:0:00", b"frame", 1)]


@pytest.fixture(scope="module")
def granted():
    with running_redis() as r:
        async def grant():
            c = r.client()
            users = await acl.apply_users(c, r.data_dir, [P, PX])
            await c.aclose()
            return users

        users = asyncio.run(grant())
        yield r, users


async def _refused(coro) -> str:
    try:
        await coro
    except ResponseError as e:
        return str(e)
    raise AssertionError("the server did not refuse it")


def test_every_role_has_a_user_and_an_owner_only_password(granted):
    r, users = granted
    assert users == ["producer", "reader", "pipeline-p", "pipeline-p-x"]
    for user in users:
        mode = stat.S_IMODE(os.stat(acl.password_file(r.data_dir, user)).st_mode)
        assert mode == 0o600, f"{user}: {oct(mode)}"
    conf = (r.data_dir / "redis" / "users.conf").read_text()
    for user in users:  # only the passwords' digests are on disk beside the users
        assert acl.password_file(r.data_dir, user).read_text().strip() not in conf


def test_a_pipeline_user_works_on_its_own_streams_only(granted):
    r, _ = granted

    async def go():
        c = r.client("pipeline-p")
        own = RedisBuffer(c, "isb-p-a-b-1")
        written = await own.write(FRAME)
        read = await own.read(None, None, 10)
        released = await own.release(written[0].offset)
        loss = await own.state()
        other = RedisBuffer(c, "isb-p-x-a-b-0")
        refusals = [
            await _refused(other.write(FRAME)),
            await _refused(other.read(None, None, 10)),
            await _refused(c.xrange(BufferKeys("isb-p-x-a-b-0").stream)),
            await _refused(c.flushall()),
            await _refused(c.config_get("*")),
            await _refused(c.keys("*")),
            await _refused(c.execute_command("ACL", "LIST")),
            await _refused(c.execute_command("SCRIPT", "FLUSH")),
            # a script runs with its caller's rights: EVAL is no way around them
            await _refused(c.eval("return redis.call('FLUSHALL')", 0)),
            await _refused(c.eval("return redis.call('XLEN', KEYS[1])", 1, BufferKeys("isb-p-x-a-b-0").stream)),
        ]
        await c.aclose()
        return written, read, released, loss, refusals

    written, read, released, loss, refusals = asyncio.run(go())
    assert not written[0].duplicate and [f.payload for f in read] == [b"frame"] and released == 1
    assert loss.incarnation is not None
    assert len(refusals) == 10 and all(("NOPERM" in e or "no permissions" in e or "can't run" in e)
                                       for e in refusals), refusals


def test_the_producer_only_publishes_into_source_streams(granted):
    r, _ = granted

    async def go():
        c = r.client("producer")
        src = RedisBuffer(c, "src-p-in")
        written = await src.write(FRAME)
        again = await src.write(FRAME)
        refusals = [
            await _refused(RedisBuffer(c, "isb-p-a-b-0").write(FRAME)),  # an edge buffer: the steps'
            await _refused(src.read(None, None, 10)),  # reads nothing, not even its own sources
            await _refused(c.xrange(BufferKeys("src-p-in").stream)),
            await _refused(src.release(written[0].offset)),
            await _refused(c.flushall()),
        ]
        await c.aclose()
        return written, again, refusals

    written, again, refusals = asyncio.run(go())
    assert not written[0].duplicate and again[0].duplicate
    assert len(refusals) == 5


def _noperm(errors: list[str]) -> bool:
    return all("NOPERM" in e or "no permissions" in e for e in errors)


def test_a_pipeline_user_reads_and_writes_its_own_buckets_only(granted):
    """Its status (control, ledger) bucket: every KeyValue operation; another pipeline's buckets:
    nothing; a reference table its grant lists: read only; one it does not list: nothing."""
    r, _ = granted
    ref, unlisted = naming.reference_bucket("p", "t"), naming.reference_bucket("p", "u")

    async def go():
        async with RedisStore(r.client()) as admin:
            await (await admin.kv(ref)).put("k", b"table")
        async with RedisStore.open(r.data_dir, "pipeline-p") as store:
            own = []
            for bucket in acl.pipeline_buckets("p"):
                kv = await store.kv(bucket)
                await kv.put("step.a", b"running")
                own.append((await kv.get("step.a"), await kv.add("n", 2), await kv.keys()))
                await kv.delete("step.a")
            whole = await store.client.hgetall(kv_key(naming.status_bucket("p")))
            table = await (await store.kv(ref)).get("k")
            other = await store.kv(naming.status_bucket("p-x"))
            refusals = [
                await _refused(other.put("step.a", b"x")),
                await _refused(other.get("step.a")),
                await _refused(other.keys()),
                await _refused(other.add("n", 1)),
                await _refused((await store.kv(naming.control_bucket("p-x"))).get("step.a")),
                await _refused((await store.kv(ref)).put("k", b"mine")),
                await _refused((await store.kv(unlisted)).get("k")),
            ]
        return own, whole, table, refusals

    own, whole, table, refusals = asyncio.run(go())
    assert own == [(b"running", 2, ["n", "step.a"])] * 3
    assert whole == {b"n": b"2"} and table == b"table"
    assert len(refusals) == 7 and _noperm(refusals), refusals


def test_the_producer_reaches_no_bucket(granted):
    r, _ = granted

    async def go():
        async with RedisStore.open(r.data_dir, "producer") as store:
            kv = await store.kv(naming.status_bucket("p"))
            return [await _refused(kv.put("k", b"v")), await _refused(kv.get("k"))]

    refusals = asyncio.run(go())
    assert _noperm(refusals), refusals


def test_the_reader_reads_every_granted_pipeline_and_writes_nothing(granted):
    """What the UI shows: every granted pipeline's partition state and ranges, its status bucket;
    no write anywhere (not even through a script), no other key."""
    r, _ = granted

    async def go():
        admin = r.client()
        await RedisBuffer(admin, "isb-p-x-a-b-0").write(FRAME)
        await admin.hset(kv_key(naming.status_bucket("p")), "step.a", "running")
        await admin.aclose()
        async with RedisStore.open(r.data_dir, "reader") as store:
            c = store.client
            state = [await RedisBuffer(c, s).state() for s in ("isb-p-a-b-0", "isb-p-x-a-b-0", "src-p-x-in")]
            read = await RedisBuffer(c, "isb-p-x-a-b-0").read(None, None, 10)
            status = await (await store.kv(naming.status_bucket("p"))).items()
            refusals = [
                await _refused(RedisBuffer(c, "isb-p-a-b-0").write(FRAME)),
                await _refused(RedisBuffer(c, "isb-p-x-a-b-0").release(1)),
                await _refused((await store.kv(naming.status_bucket("p"))).put("step.a", b"x")),
                await _refused(c.eval("return redis.call('DEL', KEYS[1])", 1, BufferKeys("isb-p-a-b-0").stream)),
                await _refused((await store.kv(naming.reference_bucket("p", "t"))).get("k")),
                await _refused(c.xrange(BufferKeys("isb-other-a-b-0").stream)),
                await _refused(c.flushall()),
            ]
        return state, read, status, refusals

    state, read, status, refusals = asyncio.run(go())
    assert state[1] is not None and [f.payload for f in read] == [b"frame"]
    assert status["step.a"] == b"running"  # (beside what the pipeline user wrote there)
    assert len(refusals) == 7 and all(("NOPERM" in e or "no permissions" in e or "can't run" in e)
                                      for e in refusals), refusals


def test_the_users_survive_a_restart(granted):
    r, _ = granted
    r.restart()

    async def go():
        c = r.client("pipeline-p-x")
        written = await RedisBuffer(c, "isb-p-x-a-b-0").write(FRAME)
        refused = await _refused(RedisBuffer(c, "isb-p-a-b-0").write(FRAME))
        await c.aclose()
        return written, refused

    written, refused = asyncio.run(go())
    assert len(written) == 1 and refused


def test_key_patterns_match_their_keys_only():
    assert acl.key_patterns(["isb-p-a-b-0"]) == [
        "~isbflow:{isb-p-a-b-0}", "~isbflow:{isb-p-a-b-0}:ids", "~isbflow:{isb-p-a-b-0}:inc"]
    assert acl.key_patterns(["we*ird?[1]"])[0] == r"~isbflow:{we\*ird\?\[1\]}"
    assert acl.bucket_patterns(["isbflow-p-status"]) == ["~isbflow:kv:{isbflow-p-status}"]
    assert acl.bucket_patterns(["isbflow-p-ref-t"], read_only=True) == ["%R~isbflow:kv:{isbflow-p-ref-t}"]


def test_granting_again_gives_the_current_grants_and_removes_dropped_pipelines():
    with running_redis() as r:
        async def go():
            admin = r.client()
            await acl.apply_users(admin, r.data_dir, [P, PX])
            narrowed = roles.PipelineGrant("p", ("isb-p-a-b-0",), (), (), "isb-p-dlq", (), ())
            users = await acl.apply_users(admin, r.data_dir, [narrowed])
            left = [u.decode() for u in await admin.execute_command("ACL", "USERS")]
            await admin.aclose()
            c = r.client("pipeline-p")
            kept = await RedisBuffer(c, "isb-p-a-b-0").write(FRAME)
            dropped = await _refused(RedisBuffer(c, "isb-p-a-b-1").write(FRAME))
            await c.aclose()
            return users, left, kept, dropped

        users, left, kept, dropped = asyncio.run(go())
    assert users == ["producer", "reader", "pipeline-p"]
    assert "pipeline-p-x" not in left and "pipeline-p" in left
    assert len(kept) == 1 and dropped

