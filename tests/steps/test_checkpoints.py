"""A vertex with several out edges carried over from one query per edge to one query per vertex
(:mod:`isbflow.steps.checkpoints`), on checkpoints laid out as Spark writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from isbflow.spec import load_specs
from isbflow.spec.paths import DataDir
from isbflow.steps.checkpoints import committed_end, fan_out_start
from isbflow.steps.restart import StepError

ROOT = Path(__file__).resolve().parents[2]
P = load_specs([ROOT / "pipelines" / "logs.yaml"]).only_pipeline()
META = '{"batchWatermarkMs":0,"batchTimestampMs":1795688505005,"conf":{"spark.sql.shuffle.partitions":"2"}}'


def offsets(seq0: int, seq1: int) -> dict:
    return {"isb-logs-parse-enrich-0": {"inc": "2026-11-26T10:18:34.038291213Z", "seq": seq0},
            "isb-logs-parse-enrich-1": {"inc": "2026-11-26T10:18:34.039619462Z", "seq": seq1}}


def spark_checkpoint(path: Path, batches: dict[int, dict], committed: int | None) -> None:
    """What Spark leaves: ``offsets/<n>`` for every planned batch, ``commits/<n>`` for each done."""
    (path / "offsets").mkdir(parents=True)
    (path / "commits").mkdir()
    (path / "metadata").write_text('{"id":"4548f026-87e6-4e3d-a4f6-28f32ebb6c6d"}')
    for n, o in batches.items():
        (path / "offsets" / str(n)).write_text(f"v1\n{META}\n{json.dumps(o)}")
    for n in range(0, (-1 if committed is None else committed) + 1):
        (path / "commits" / str(n)).write_text('v1\n{"nextBatchWatermarkMs":0}')


def test_committed_end_is_the_newest_committed_batch_not_the_planned_one(tmp_path):
    spark_checkpoint(tmp_path / "q", {0: offsets(3, 4), 1: offsets(9, 9), 2: offsets(12, 15)}, committed=1)
    assert committed_end(tmp_path / "q") == offsets(9, 9)
    spark_checkpoint(tmp_path / "none", {0: offsets(3, 4)}, committed=None)
    assert committed_end(tmp_path / "none") is None


def test_agreeing_per_edge_checkpoints_are_carried_over_and_moved_aside(tmp_path):
    dirs = DataDir(tmp_path)
    assert P.query_to("enrich") is None and P.query_to("parse") == "enrich" and P.query_to("raw") is None
    for to in ("raw", "minutely"):
        spark_checkpoint(dirs.checkpoint("logs", "enrich", to), {0: offsets(5, 6), 1: offsets(20, 21)}, committed=1)
    assert fan_out_start(tmp_path, P, "enrich") == offsets(20, 21)
    assert not dirs.checkpoint("logs", "enrich", "raw").exists()
    aside = [d for d in dirs.checkpoints("logs").iterdir() if d.name.startswith("_per-edge-")]
    assert len(aside) == 1 and sorted(c.name for c in aside[0].iterdir()) == ["enrich-to-minutely", "enrich-to-raw"]
    assert fan_out_start(tmp_path, P, "enrich") is None  # nothing left to carry over
    assert fan_out_start(tmp_path, P, "parse") is None  # one out edge: its checkpoint keeps its name


def test_per_edge_checkpoints_at_different_offsets_refuse_to_start(tmp_path):
    dirs = DataDir(tmp_path)
    spark_checkpoint(dirs.checkpoint("logs", "enrich", "raw"), {0: offsets(20, 21)}, committed=0)
    spark_checkpoint(dirs.checkpoint("logs", "enrich", "minutely"), {0: offsets(5, 6)}, committed=0)
    with pytest.raises(StepError, match=r"step 'enrich' has one checkpoint per out edge .*different input "
                                        r"offsets.*isbflow replay --mode recover"):
        fan_out_start(tmp_path, P, "enrich")
    assert dirs.checkpoint("logs", "enrich", "raw").exists()  # nothing moved: the user decides
    # a new query's checkpoint exists already: the old ones are not looked at
    dirs.checkpoint("logs", "enrich").mkdir()
    assert fan_out_start(tmp_path, P, "enrich") is None
