"""A step's replicas as task slots: the reader plans each batch with at least as many tasks as its
autoscaler's replicas file says (isbflow.connector.offsets.replicas), read anew for every batch.
Pure: the plan needs no NATS and no Spark."""

from __future__ import annotations

from isbflow.connector.offsets import StreamOffset, replicas
from isbflow.connector.options import ReaderOptions
from isbflow.connector.reader import JetStreamStreamReader
from isbflow.isb.settings import NatsSettings, settings_to_json


def _reader(tmp_path, **extra: str) -> JetStreamStreamReader:
    opts = ReaderOptions.parse({"streams": "src", "mode": "events", "sourceName": "in",
                                "settings": settings_to_json(NatsSettings(servers=("nats://127.0.0.1:1",))), **extra})
    return JetStreamStreamReader(opts, None)


def _tasks(reader: JetStreamStreamReader, events: int) -> list[tuple[int, int]]:
    plan = reader._plan({"src": StreamOffset("i", 0)}, {"src": StreamOffset("i", events)})
    return [(t.first, t.last) for t in plan]


def test_a_batch_is_planned_in_as_many_tasks_as_the_replicas_file_says(tmp_path):
    f = tmp_path / "in.replicas"
    reader = _reader(tmp_path, replicasFile=str(f))
    assert _tasks(reader, 20_000) == [(1, 20_000)]  # no file yet: one replica
    f.write_text("2\n")
    assert _tasks(reader, 20_000) == [(1, 10_000), (10_001, 20_000)]  # read anew for the next batch
    assert _tasks(reader, 6_000) == [(1, 6_000)]  # too small to split (5,000 events a task at least)
    f.write_text("1")
    assert _tasks(reader, 20_000) == [(1, 20_000)]
    assert _tasks(_reader(tmp_path), 20_000) == [(1, 20_000)]  # no replicasFile option: as before


def test_an_unreadable_replicas_file_counts_as_one(tmp_path):
    f = tmp_path / "r"
    assert replicas(None) == 1 and replicas(str(f)) == 1
    f.write_text("two")
    assert replicas(str(f)) == 1
    f.write_text("0")
    assert replicas(str(f)) == 1
    f.write_text("3")
    assert replicas(str(f)) == 3
