"""``isbflow.ops.rescale`` and ``isb diff`` on Redis buffers (a real redis-server, the pipeline not running, no
Spark): the partitions a larger count adds are made, with the pipeline's ACL user allowed on
them; a smaller count removes the extra partitions and their committed sequences; unread entries
refuse a removal, and ``force`` drops them counted. The same contract as on JetStream
(tests/ops/test_rescale.py); draining and resuming a running pipeline is store-agnostic
(tests/ops/test_rescale_pipeline.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml
from redis.exceptions import NoPermissionError

from isbflow.isb.connect import session
from isbflow.isb.provision_partitions import held_partitions
from isbflow.isb.roles import pipeline_user
from isbflow.isb.state import get_committed, put_committed
from isbflow.isb.store import OutFrame
from isbflow.ops import isb as ops_isb
from isbflow.ops import rescale as ops
from isbflow.spec import derived, load_specs
from tests.ops.test_rescale import SPEC


def write_spec(folder: Path, raw: int) -> Path:
    """tests/specs/rescale.yaml on a native Redis service, with ``raw``'s partitions."""
    docs = list(yaml.safe_load_all(SPEC.read_text()))
    next(d for d in docs if d["kind"] == "InterStepBufferService")["spec"] = {"redis": {"native": {"persistence": True}}}
    pipeline = next(d for d in docs if d["kind"] == "Pipeline")
    next(v for v in pipeline["spec"]["vertices"] if v["name"] == "raw")["partitions"] = raw
    path = folder / "rescale-redis.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return path


def streams(n: int) -> list[str]:
    return [derived.edge_stream("resc", "in", "raw", i) for i in range(n)]


def test_grow_shrink_and_unread_partitions_on_redis(redis_server, tmp_path):
    admin, data_dir = redis_server.settings(), redis_server.data_dir

    def load(raw: int):
        path = write_spec(tmp_path, raw)
        specs = load_specs([path])
        return path, specs, specs.only_pipeline()

    def rescale(raw: int, **kw) -> ops.Rescaled:
        path, specs, p = load(raw)
        return ops.rescale(path, specs, p, "raw", admin, data_dir, partitions=raw, **kw)

    async def on_store(settings, fn):
        async with session(settings) as store:
            return await fn(store)

    def held(raw: int) -> list[str]:
        p = load(raw)[2]
        return [h.stream for h in asyncio.run(on_store(admin, lambda s: held_partitions(s, p, "raw")))]

    _, specs, p = load(2)
    ops_isb.apply(admin, specs, p.name, data_dir=data_dir)
    user = ops_isb.role_settings(admin, data_dir, pipeline_user(p.name))

    grown = rescale(4)
    assert (grown.before, grown.after, grown.created, grown.removed) == (2, 4, streams(4)[2:], [])
    assert held(4) == streams(4)
    assert ops_isb.diff(admin, load(4)[1]) == []  # isb diff: the store holds what the spec says
    drift = ops_isb.diff(admin, load(1)[1])  # the spec says 1, the store holds 4
    assert [(d.resource, d.field, d.spec, d.server, d.cls.value) for d in drift] == [
        (s, "exists", False, True, "safe") for s in streams(4)[1:]]
    # the pipeline's ACL user was given the new partitions (its writer routes records into them)
    written = asyncio.run(on_store(user, lambda s: s.buffer(streams(4)[3]).write([OutFrame("f-1", b"x", 1)])))
    assert [w.duplicate for w in written] == [False]
    with pytest.raises(NoPermissionError):  # and nothing beyond them
        asyncio.run(on_store(user, lambda s: s.buffer(derived.edge_stream("other", "in", "raw", 0)).write(
            [OutFrame("f-1", b"x", 1)])))
    assert not rescale(4).changed

    # partition 3 holds an entry raw never committed: its removal is refused, naming it
    with pytest.raises(ops.RescaleRefused) as e:
        rescale(2)
    assert f"{streams(4)[3]} (buffer in->raw, partition 3): 1 unread message(s), removed by the rescale" in str(e.value)
    assert held(4) == streams(4)  # nothing changed

    async def commit(store):
        await put_committed(store, "resc", "raw", {streams(4)[2]: 0})
        return await get_committed(store, "resc", "raw", streams(4)[2])

    assert asyncio.run(on_store(admin, commit)) == 0
    forced = rescale(2, force=True)
    assert forced.removed == streams(4)[2:] and forced.dropped == {streams(4)[3]: 1}
    assert held(2) == streams(2)
    assert ops_isb.diff(admin, load(2)[1]) == []
    asyncio.run(on_store(admin, lambda s: s.buffer(streams(2)[1]).delete()))  # lost, or never applied
    assert [(d.resource, d.field, d.spec, d.server) for d in ops_isb.diff(admin, load(2)[1])] == [
        (streams(2)[1], "exists", True, False)]
    # a removed partition's committed sequence goes with it: created again, it starts unread
    assert asyncio.run(on_store(admin, lambda s: get_committed(s, "resc", "raw", streams(4)[2]))) is None
