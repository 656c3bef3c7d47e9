"""Reprocess and shadow runs on Redis buffers (real redis-server, the session Spark, real Delta
tables): the pipeline of tests/recovery/test_reprocess.py on a native Redis service
(tests/specs/reprocess-redis.yaml), run once with transform version 1 as its own ACL user. A
shadow reprocess of a range with version 2 leaves the live tables as they were and shows the
range changed in its diff, its suite passing; the promote replaces exactly the range's rows in one
commit per sink, the aggregates equal a recount; a range still in flight in a Redis partition is
refused. The source is read again from the Redis source stream, which keeps what its step
committed (up to ``bufferMaxLength`` events)."""

from __future__ import annotations

import asyncio

import pytest
from deltalake import DeltaTable

from isbflow.isb.roles import pipeline_user
from isbflow.ops import isb as ops_isb
from isbflow.ops import replay as ops_replay
from isbflow.ops.produce import produce
from isbflow.spec import load_specs
from isbflow.steps.runner import PipelineRunner
from tests.conftest import ROOT
from tests.helpers import reprocess_transforms
from tests.recovery.test_reprocess import (
    COUNT,
    MALFORMED_EVERY,
    check_agg_equals_recount,
    good_seqs,
    raw_rows,
    seq_of,
)
from tests.recovery.test_shadow import SUITE, versions

SPEC = ROOT / "tests" / "specs" / "reprocess-redis.yaml"


def run_once(spark, specs, p, user, data_dir, only=None) -> None:
    runner = PipelineRunner(spark, specs, p, user, data_dir)
    try:
        runner.run_available_now(only=only)
    finally:
        runner.close()


def test_a_shadow_reprocess_on_redis_is_reviewed_then_promoted(spark, redis_server, tmp_path):
    spec = tmp_path / "reprocess-redis.yaml"
    spec.write_text(SPEC.read_text() + SUITE)
    specs = load_specs(spec)
    p = specs.only_pipeline()
    admin = redis_server.settings()
    ops_isb.apply(admin, specs, p.name, data_dir=redis_server.data_dir)
    user = ops_isb.role_settings(admin, redis_server.data_dir, pipeline_user(p.name))
    data_dir = tmp_path / "data"
    assert asyncio.run(produce(admin, p, count=COUNT, seed=3, malformed_every=MALFORMED_EVERY)).published == COUNT
    reprocess_transforms.VERSION = 1
    run_once(spark, specs, p, user, data_dir)
    before = raw_rows(data_dir)
    assert {seq_of(i) for i in before} == good_seqs()
    v_raw, v_agg = versions(data_dir)
    lo, hi = 2001, 3000
    in_range = {i for i in before if lo <= seq_of(i) <= hi}
    go = dict(specs=specs, p=p, settings=admin, data_dir=data_dir)

    reprocess_transforms.VERSION = 2
    review = ops_replay.replay(lambda: spark, **go, mode="reprocess", from_offset=lo, to_offset=hi, shadow=True)
    assert review.ok and review.promotable, review.summary()
    assert versions(data_dir) == (v_raw, v_agg) and raw_rows(data_dir) == before  # live tables untouched
    d = review.record.sink("raw").diff
    assert (d["rows_before"], d["changed"], d["added"], d["removed"]) == (len(in_range), len(in_range), 0, 0)

    promoted = ops_replay.promote(lambda: spark, **go, run=review.run)
    assert promoted.ok, promoted.summary()
    after = raw_rows(data_dir)
    assert set(after) == set(before)
    assert {i for i, r in after.items() if r["version"] == 2} == in_range
    assert all(after[i] == before[i] for i in set(before) - in_range)
    assert versions(data_dir)[0] == v_raw + 1  # one commit on the live raw table
    assert DeltaTable(str(data_dir / "sinks/rp/raw")).history(1)[0]["operation"] == "MERGE"
    check_agg_equals_recount(data_dir, after)

    # records of a range still in a Redis partition (not yet in the sinks) are refused
    assert asyncio.run(produce(admin, p, count=300, seed=3, start=COUNT, malformed_every=MALFORMED_EVERY)).published == 300
    run_once(spark, specs, p, user, data_dir, only=["in"])
    with pytest.raises(ops_replay.ReplayError, match="still in flight in buffer isb-rp-in-tag-"):
        ops_replay.replay(lambda: spark, **go, mode="reprocess", from_offset=COUNT - 99, to_offset=COUNT + 100)
