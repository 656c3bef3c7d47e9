"""Bounded state of a long run: the writer's stats dir keeps running totals and prunes per-batch files.

The writer's driver commit is called directly with task reports built here
(no NATS, no Spark: commit only sums and records); the Spark end to end of the
same files is in tests/connector/test_writer.py.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from isbflow.connector.writer import (
    TOTALS_FILE,
    JetStreamStreamWriter,
    JetStreamWriteReport,
    WriterOptions,
    read_write_stats,
    read_write_totals,
)
from isbflow.isb.connect import NatsSettings

COUNTS = ("frames", "rows", "duplicate_frames", "duplicate_rows", "discarded_frames", "discarded_rows",
          "dead_lettered")


def writer(stats_dir: Path, keep: int) -> JetStreamStreamWriter:
    opts = WriterOptions(settings=NatsSettings(servers=("nats://127.0.0.1:1",)), pipeline="bp", step="parse",
                         to="agg", partitions=2, stats_dir=str(stats_dir), stats_keep=keep)
    return JetStreamStreamWriter(opts, task_identity=lambda: (0, 0))


def reports(rng: random.Random, batch_id: int) -> list[JetStreamWriteReport | None]:
    out: list[JetStreamWriteReport | None] = []
    for task in range(2):
        r = JetStreamWriteReport(batch_id, task, blocked_seconds=rng.choice((0.0, 0.25)))
        for p in range(2):
            for name in COUNTS:
                r.count(p, name, rng.randrange(0, 50))
        out.append(r)
    return out


def files(stats_dir: Path) -> list[str]:
    return sorted(p.name for p in stats_dir.iterdir())


def test_many_batches_keep_at_most_keep_plus_one_files_and_totals_equal_the_sum(tmp_path):
    stats_dir, keep, batches = tmp_path / "stats", 10, 400
    w, rng = writer(stats_dir, keep), random.Random(19)
    expected = dict.fromkeys(COUNTS, 0)
    blocked = 0.0
    for b in range(batches):
        msgs = reports(rng, b)
        for m in msgs:
            for name in COUNTS:
                expected[name] += m.total(name)
            blocked += m.blocked_seconds
        w.commit(msgs, b)
        assert len(files(stats_dir)) <= keep + 1, files(stats_dir)

    assert files(stats_dir) == sorted([TOTALS_FILE] + [f"batch-{b}.json" for b in range(batches - keep, batches)])
    totals = read_write_totals(stats_dir)
    assert {n: totals[n] for n in COUNTS} == expected
    assert totals["batches"] == batches and totals["tasks"] == 2 * batches
    assert (totals["firstBatchId"], totals["lastBatchId"]) == (0, batches - 1)
    assert abs(totals["blockedSeconds"] - blocked) < 1e-6
    assert sum(c["rows"] for c in totals["partitions"].values()) == expected["rows"]

    # read_write_stats: the pruned batches as one leading entry, then the kept ones; sums are over every batch
    stats = read_write_stats(stats_dir)
    assert stats[0]["pruned"] is True and stats[0]["batches"] == batches - keep
    assert [s["batchId"] for s in stats[1:]] == list(range(batches - keep, batches))
    assert {n: sum(s[n] for s in stats) for n in COUNTS} == expected

    # the totals are one file: the per-batch files are not read again
    for p in stats_dir.glob("batch-*.json"):
        p.write_text("not json")
    assert {n: read_write_totals(stats_dir)[n] for n in COUNTS} == expected


def test_a_recommitted_batch_is_not_counted_twice(tmp_path):
    stats_dir = tmp_path / "stats"
    w, rng = writer(stats_dir, 5), random.Random(7)
    for b in range(3):
        w.commit(reports(rng, b), b)
    before = read_write_totals(stats_dir)
    first_stats = json.loads((stats_dir / "batch-2.json").read_text())

    w.commit(reports(rng, 2), 2)  # Spark commits the last batch again after a restart
    assert read_write_totals(stats_dir) == before
    assert json.loads((stats_dir / "batch-2.json").read_text()) == first_stats

    w.commit(reports(rng, 3), 3)
    assert read_write_totals(stats_dir)["batches"] == 4


def test_a_pruned_file_left_by_a_crash_is_not_counted_twice(tmp_path):
    stats_dir = tmp_path / "stats"
    w, rng = writer(stats_dir, 3), random.Random(3)
    w.commit(reports(rng, 0), 0)
    shutil.copy(stats_dir / "batch-0.json", tmp_path / "batch-0.json")
    for b in range(1, 5):
        w.commit(reports(rng, b), b)
    # the driver died after writing the totals, before unlinking the pruned file
    shutil.copy(tmp_path / "batch-0.json", stats_dir / "batch-0.json")
    before = read_write_totals(stats_dir)
    assert sum(s["rows"] for s in read_write_stats(stats_dir)) == before["rows"]

    w.commit(reports(rng, 5), 5)
    totals = read_write_totals(stats_dir)
    assert not (stats_dir / "batch-0.json").exists()
    assert totals["pruned"]["batches"] == 3  # batches 0, 1 and 2, batch 0 once
    assert sum(s["rows"] for s in read_write_stats(stats_dir)) == totals["rows"]


def test_a_stats_dir_written_before_totals_is_summed_once(tmp_path):
    stats_dir = tmp_path / "stats"
    stats_dir.mkdir()
    for b in range(4):
        (stats_dir / f"batch-{b}.json").write_text(json.dumps({"batchId": b, "rows": 10, "dead_lettered": 1}))
    assert read_write_totals(stats_dir)["rows"] == 40

    w, rng = writer(stats_dir, 2), random.Random(1)
    msgs = reports(rng, 4)
    w.commit(msgs, 4)
    totals = read_write_totals(stats_dir)
    assert totals["rows"] == 40 + sum(m.total("rows") for m in msgs)
    assert totals["dead_lettered"] == 4 + sum(m.total("dead_lettered") for m in msgs)
    assert files(stats_dir) == ["batch-3.json", "batch-4.json", TOTALS_FILE]
    assert sum(s["rows"] for s in read_write_stats(stats_dir)) == totals["rows"]
