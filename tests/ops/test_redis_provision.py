"""A pipeline on a native Redis service (pipelines/logs-redis.yaml), up to the point its steps start,
on a real redis-server: the service started from the spec, its settings resolved from the data
dir, its streams provisioned (again: unchanged) with its own ACL user, which reaches its pipeline's
buckets and streams and nothing of another pipeline's; a second pipeline claiming its source stream
refused; events produced into the source stream once, however often; a driver's environment
carrying the user's settings and no other secret."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio
from redis.exceptions import NoPermissionError

from isbflow.isb import state as st
from isbflow.isb.connect import RedisSettings, connect, resolve_settings
from isbflow.isb.redis.keys import BufferKeys
from isbflow.isb.redis.server import stop_redis
from isbflow.isb.roles import pipeline_grants, pipeline_user
from isbflow.ops import isb as ops_isb
from isbflow.ops import isb_service
from isbflow.ops.produce import produce
from isbflow.spec import load_specs
from isbflow.steps.driver import driver_env
from tests.conftest import ROOT

SPEC = ROOT / "pipelines" / "logs-redis.yaml"


@pytest.fixture
def redis_demo(tmp_path):
    specs = load_specs(SPEC)
    p = specs.only_pipeline()
    data_dir = tmp_path / "data"
    isb_service.up(specs.service_for(p), data_dir)
    try:
        yield specs, p, data_dir
    finally:
        stop_redis(data_dir)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_pipeline_is_provisioned_on_redis_with_its_own_user(redis_demo):
    specs, p, data_dir = redis_demo
    admin = resolve_settings(data_dir=data_dir, service=specs.service_for(p))
    assert isinstance(admin, RedisSettings) and admin.user is None and admin.password
    first = ops_isb.apply(admin, specs, p.name, data_dir=data_dir)
    streams = [r.name for r in first.resources]
    assert sorted(streams) == sorted({*pipeline_grants(p).buffers, *pipeline_grants(p).sources, pipeline_grants(p).dlq})
    assert {r.action.value for r in first.resources} == {"created"}
    again = ops_isb.apply(admin, specs, p.name, data_dir=data_dir)
    assert not again.changed and {r.action.value for r in again.resources} == {"unchanged"}

    user = ops_isb.role_settings(admin, data_dir, pipeline_user(p.name))
    assert user.user == pipeline_user(p.name) and user.password != admin.password
    same = resolve_settings(data_dir=data_dir, service=specs.service_for(p), role=pipeline_user(p.name))
    assert same == user

    async def as_user():
        store = await connect(user)
        try:
            await st.put_committed(store, p.name, "parse", {pipeline_grants(p).buffers[0]: 3})
            own = await st.get_committed(store, p.name, "parse", pipeline_grants(p).buffers[0])
            info = await store.buffers().state(pipeline_grants(p).sources[0])
            other = redis.asyncio.Redis.from_url(user.url, username=user.user, password=user.password)
            try:
                with pytest.raises(NoPermissionError):
                    await other.xlen(BufferKeys("isb-someone-else-a-b-0").stream)
                with pytest.raises(NoPermissionError):
                    await other.flushall()
            finally:
                await other.aclose()
            return own, info
        finally:
            await store.close()

    own, info = _run(as_user())
    assert own == 3 and info is not None and info.messages == 0


def test_another_pipeline_claiming_its_source_stream_is_refused(redis_demo, tmp_path):
    """Two teams' specs name the same source stream of their own (outside isbflow's namespace):
    the second to provision is refused, and the first keeps its stream and its user."""
    specs, p, data_dir = redis_demo
    admin = resolve_settings(data_dir=data_dir, service=specs.service_for(p))

    def team(name: str):
        f = tmp_path / f"{name}.yaml"
        f.write_text(SPEC.read_text().replace("name: logs-redis\n", f"name: {name}\n", 1).replace(
            "subject: logs-redis.events", f"subject: {name}.events\n          stream: team-orders"))
        specs = load_specs(f)
        return specs, specs.only_pipeline()

    (a_specs, a), (b_specs, b) = team("team-a"), team("team-b")
    assert pipeline_grants(a).sources == pipeline_grants(b).sources == ("team-orders",)
    ops_isb.apply(admin, a_specs, a.name, data_dir=data_dir)
    with pytest.raises(ops_isb.ProvisionRefused, match=r"team-b may not use streams another pipeline owns: "
                                                       r"team-orders \(pipeline team-a\)"):
        ops_isb.apply(admin, b_specs, b.name, data_dir=data_dir)
    assert (data_dir / "redis" / f"{pipeline_user('team-a')}.password").exists()
    assert not (data_dir / "redis" / f"{pipeline_user('team-b')}.password").exists()


def test_events_are_produced_into_the_source_stream_once(redis_demo):
    specs, p, data_dir = redis_demo
    admin = resolve_settings(data_dir=data_dir, service=specs.service_for(p))
    ops_isb.apply(admin, specs, p.name, data_dir=data_dir)
    first = _run(produce(admin, p, count=1200, seed=3))
    again = _run(produce(admin, p, count=1500, seed=3))
    assert (first.published, first.duplicates) == (1200, 0)
    assert (again.published, again.duplicates) == (300, 1200)

    async def state():
        store = await connect(admin)
        try:
            return await store.buffers().state(pipeline_grants(p).sources[0])
        finally:
            await store.close()

    st = _run(state())
    assert (st.first_seq, st.last_seq, st.messages) == (1, 1500, 1500)


def test_a_drivers_environment_holds_its_users_settings_and_no_other_secret(redis_demo, monkeypatch):
    specs, p, data_dir = redis_demo
    admin = resolve_settings(data_dir=data_dir, service=specs.service_for(p))
    ops_isb.apply(admin, specs, p.name, data_dir=data_dir)
    user = ops_isb.role_settings(admin, data_dir, pipeline_user(p.name))
    env = driver_env(user, data_dir, base={"REDIS_PASSWORD": "someone-elses", "NATS_PASSWORD": "x", "HOME": "/h"})
    assert (env["REDIS_URL"], env["REDIS_USER"], env["REDIS_PASSWORD"]) == (user.url, user.user, user.password)
    assert "NATS_PASSWORD" not in env and admin.password not in env.values()
    for k, v in env.items():
        if k.startswith("REDIS_"):
            monkeypatch.setenv(k, v)
    # the driver finds its settings again in that environment, without reading the data dir
    assert resolve_settings(data_dir=data_dir / "elsewhere", service=specs.service_for(p)) == user


def test_status_shows_each_stream_and_delete_removes_them_with_the_user(redis_demo):
    specs, p, data_dir = redis_demo
    admin = resolve_settings(data_dir=data_dir, service=specs.service_for(p))
    ops_isb.apply(admin, specs, p.name, data_dir=data_dir)
    _run(produce(admin, p, count=10, seed=1))
    held = {s.name: s for s in ops_isb.status(admin, specs, p.name)}
    source = pipeline_grants(p).sources[0]
    assert held[source].exists and (held[source].messages, held[source].last_seq) == (10, 10)
    assert all(s.exists for s in held.values())
    deleted = ops_isb.delete(admin, specs, p.name, data_dir=data_dir)
    assert sorted(deleted) == sorted(held)
    assert not any(s.exists for s in ops_isb.status(admin, specs, p.name))
    user = ops_isb.role_settings(admin, data_dir, pipeline_user(p.name))
    with pytest.raises(ops_isb.Unreachable, match="refused"):  # the ACL user is gone with its grant
        _run(connect(user))
