"""A rescale of a running pipeline under load: real nats-server, real detached Spark driver.

tests/specs/rescale.yaml runs (``in`` -> ``raw``, its buffer keyed by ``service``; ``in`` ->
``counts``, an aggregation, -> ``agg``) while a producer publishes; ``raw``'s buffer goes from 2
to 4 partitions while the producer goes on. Afterwards the raw Delta sink holds every event
exactly once, every key went to one partition of the new count, ``isb diff`` finds no drift,
and a rescale of the aggregation is refused with its reason. Every driver is stopped by PID
at teardown.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict

import pytest
from deltalake import DeltaTable

from isbflow.isb import frames
from isbflow.isb.connect import session
from isbflow.ops import isb as ops_isb
from isbflow.ops import pipeline as pipeline_ops
from isbflow.ops import rescale as ops
from isbflow.ops.produce import produce
from isbflow.spec import load_specs
from isbflow.steps.launch import stop_launch
from tests.conftest import ROOT
from tests.ops.test_rescale import streams, write_spec

pytestmark = pytest.mark.slow

SEED = 11


class Live:
    """The spec under tmp_path (rewritten as a user edits it), the data dir, the ISB settings."""

    def __init__(self, nats_server, tmp_path):
        self.folder = tmp_path / "pipelines"
        self.folder.mkdir()
        self.path = write_spec(self.folder)
        self.data_dir = tmp_path / "data"
        self.settings = nats_server.settings

    def edit(self, **partitions: int):
        write_spec(self.folder, **partitions)
        specs = load_specs([self.path])
        return specs, specs.only_pipeline()

    def produce(self, p, count: int, start: int, rate: float | None = None) -> None:
        report = asyncio.run(produce(self.settings, p, count=count, seed=SEED, start=start, rate=rate,
                                     malformed_every=None))
        assert report.published == count

    def raw_ids(self) -> list[str]:
        return DeltaTable(str(self.data_dir / "sinks/resc/raw")).to_pyarrow_table().column("_isb_id").to_pylist()


@pytest.fixture
def live(nats_server, tmp_path):
    lv = Live(nats_server, tmp_path)
    try:
        yield lv
    finally:
        stop_launch(lv.data_dir, "resc", grace=20)  # whatever happened, no driver outlives the test


def services_by_partition(settings, cut: dict[str, int]) -> dict[str, set[int]]:
    """service -> the partitions of raw's buffer whose frames after ``cut`` (stream -> last sequence
    before the rescale) hold it."""
    out: dict[str, set[int]] = defaultdict(set)

    async def go() -> None:
        async with session(settings) as nc:
            js = nc.jetstream()
            for i, s in enumerate(streams(4)):
                info = await js.stream_info(s)
                for seq in range(cut.get(s, 0) + 1, info.state.last_seq + 1):
                    msg = await js.get_msg(s, seq)
                    for b in frames.read_frame(msg.data, (msg.headers or {}).get(frames.HDR_ROWS)):
                        for service in b.column(b.schema.get_field_index("service")).to_pylist():
                            out[service].add(i)

    asyncio.run(go())
    return out


def test_rescale_under_load_loses_and_doubles_nothing_and_keys_stay_on_one_partition(live):
    specs, p = live.edit()  # raw: 2 partitions
    ops_isb.apply(live.settings, specs, data_dir=live.data_dir)  # the source stream, to produce into
    before, during, after = 1500, 2000, 500
    live.produce(p, before, 0)
    started = pipeline_ops.start(live.path, specs, p, live.settings, live.data_dir, master="local[2]", workdir=ROOT)
    check = pipeline_ops.wait_state(live.settings, p, live.data_dir, "running", timeout=300, processed=True)
    assert check.done, f"{check}\n{started.launch.log_tail(40)}"

    specs, p = live.edit(raw=4)  # the user sets partitions: 4, then rescales
    producer = threading.Thread(target=live.produce, args=(p, during, before, 150.0))
    producer.start()
    try:
        out = ops.rescale(live.path, specs, p, "raw", live.settings, live.data_dir, partitions=4, workdir=ROOT)
    finally:
        producer.join()
    print(f"rescale 2 -> 4 under load: {out.seconds:.1f}s")
    assert (out.before, out.after, out.created, out.removed) == (2, 4, streams(4)[2:], [])
    assert set(out.cut) == set(streams(2))
    assert ops_isb.diff(live.settings, specs, data_dir=live.data_dir) == []
    live.produce(p, after, before + during)

    # the aggregation keeps state in its checkpoint: refused, nothing drained or changed
    specs2, p2 = live.edit(raw=4, counts=2)
    with pytest.raises(ops.RescaleRefused, match="Spark cannot move a query's state") as refused:
        ops.rescale(live.path, specs2, p2, "counts", live.settings, live.data_dir, partitions=2)
    assert "step 'counts' is an aggregation" in str(refused.value) and not refused.value.drained
    specs, p = live.edit(raw=4)

    total = before + during + after
    drained = pipeline_ops.drain_and_wait(live.settings, p, live.data_dir, timeout=300)
    assert drained.final_offsets["in"] == {"src-resc-in": total}
    assert set(drained.final_offsets["raw"]) == set(streams(4))  # it read all four partitions
    ids = live.raw_ids()
    assert len(ids) == len(set(ids)), "an event was doubled in the raw sink"
    assert set(ids) == {f"in/0/{i + 1}" for i in range(total)}, "an event was lost"

    keys = services_by_partition(live.settings, out.cut)
    assert keys and all(len(parts) == 1 for parts in keys.values()), dict(keys)
    assert {q for parts in keys.values() for q in parts} & {2, 3}, "no key went to a new partition"
    assert out.drained and out.launch_id and out.launch_id != started.launch.launch_id
