"""``isbflow.ops.rescale`` against a real nats-server, the pipeline not running (no Spark): what
it checks, creates, removes and refuses. The rescale of a running pipeline under load is in
tests/ops/test_rescale_pipeline.py; the DAG in tests/ops/test_rescale_dag.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from isbflow.isb.connect import session
from isbflow.isb.provision_partitions import held_partitions
from isbflow.isb.state import Observed, StepStatus, get_committed, put_committed, put_status
from isbflow.ops import isb as ops_isb
from isbflow.ops import rescale as ops
from isbflow.spec import derived, load_specs
from isbflow.spec.paths import DataDir
from tests.conftest import ROOT
from tests.helpers.provision import publish

SPEC = ROOT / "tests" / "specs" / "rescale.yaml"


def write_spec(folder: Path, **partitions: int) -> Path:
    """tests/specs/rescale.yaml with ``vertex=partitions`` set, as ``folder/rescale.yaml``."""
    docs = list(yaml.safe_load_all(SPEC.read_text()))
    pipeline = next(d for d in docs if d["kind"] == "Pipeline")
    for v in pipeline["spec"]["vertices"]:
        if v["name"] in partitions:
            v["partitions"] = partitions[v["name"]]
    path = folder / "rescale.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return path


def streams(n: int) -> list[str]:
    return [derived.edge_stream("resc", "in", "raw", i) for i in range(n)]


def held(settings, p, vertex: str = "raw"):
    async def go():
        async with session(settings) as nc:
            return await held_partitions(nc, p, vertex)

    return asyncio.run(go())


class Setup:
    def __init__(self, nats_server, tmp_path):
        self.settings = nats_server.settings
        self.server_dir = nats_server.data_dir
        self.folder = tmp_path
        self.data_dir = tmp_path / "data"
        self.provision(raw=2)

    def load(self, **partitions: int):
        path = write_spec(self.folder, **partitions)
        specs = load_specs([path])
        return path, specs, specs.only_pipeline()

    def provision(self, **partitions: int) -> None:
        _, specs, _ = self.load(**partitions)
        ops_isb.apply(self.settings, specs, data_dir=self.data_dir)

    def rescale(self, vertex: str = "raw", partitions: int | None = None, **kw) -> ops.Rescaled:
        path, specs, p = self.load(**{vertex: partitions}) if partitions else self.load()
        return ops.rescale(path, specs, p, vertex, self.settings, self.data_dir, partitions=partitions, **kw)


@pytest.fixture
def setup(nats_server, tmp_path):
    return Setup(nats_server, tmp_path)


def test_grow_then_shrink_an_idle_pipeline_and_isb_diff_shows_no_drift(setup):
    grown = setup.rescale(partitions=4)
    assert (grown.before, grown.after, grown.drained, grown.launch_id) == (2, 4, False, None)
    assert grown.created == streams(4)[2:] and grown.removed == []
    path, specs, p = setup.load(raw=4)
    assert [h.stream for h in held(setup.settings, p)] == streams(4)
    assert ops_isb.diff(setup.settings, specs, data_dir=setup.data_dir) == []

    again = setup.rescale(partitions=4)  # the server already holds what the spec says
    assert not again.changed and (again.before, again.after) == (4, 4)

    _, specs, _ = setup.load(raw=1)  # the spec says 1, the server holds 4: three partitions too many
    drift = ops_isb.diff(setup.settings, specs, data_dir=setup.data_dir)
    assert [(d.resource, d.field, d.spec, d.server, d.cls.value) for d in drift] == [
        (s, "exists", False, True, "safe") for s in streams(4)[1:]]
    assert "'isbflow pipeline rescale' removes it once it is read" in drift[0].reason
    shrunk = setup.rescale(partitions=1)
    assert shrunk.removed == streams(4)[1:] and shrunk.created == [] and shrunk.dropped == {}
    _, specs, p = setup.load(raw=1)
    assert [h.stream for h in held(setup.settings, p)] == streams(1)
    assert ops_isb.diff(setup.settings, specs, data_dir=setup.data_dir) == []


def test_the_spec_must_already_say_the_count(setup):
    path, specs, p = setup.load()  # raw: 2
    with pytest.raises(ops.RescaleRefused, match=r"vertices\[1\]\.partitions of 'raw' is 2, not 4") as e:
        ops.rescale(path, specs, p, "raw", setup.settings, setup.data_dir, partitions=4)
    assert str(path) in str(e.value) and "set 'partitions: 4' on vertex raw" in str(e.value)
    with pytest.raises(ops.RescaleRefused, match="vertex 'in' reads no buffer"):
        ops.rescale(path, specs, p, "in", setup.settings, setup.data_dir)
    assert [h.stream for h in held(setup.settings, p)] == streams(2)  # nothing changed


def test_unread_messages_refuse_a_removal_and_force_drops_them_counted(setup):
    setup.provision(raw=4)
    publish(setup.settings, derived.edge_subject("resc", "in", "raw", 3), 5)
    publish(setup.settings, derived.edge_subject("resc", "in", "raw", 0), 3)
    _, _, p4 = setup.load(raw=4)

    def read_up_to(**seqs: int) -> None:  # what raw committed, as its runner records it
        async def go():
            async with session(setup.settings) as nc:
                await put_committed(nc, "resc", "raw", {streams(4)[int(i[1:])]: s for i, s in seqs.items()})

        asyncio.run(go())

    read_up_to(p0=2, p3=1)

    with pytest.raises(ops.RescaleRefused) as e:
        setup.rescale(partitions=2)
    text = str(e.value)
    assert "refused, nothing was re-partitioned" in text
    assert f"{streams(4)[3]} (buffer in->raw, partition 3): 4 unread message(s), removed by the rescale" in text
    assert f"{streams(4)[0]} (buffer in->raw, partition 0): 1 unread message(s), kept" in text
    assert streams(4)[1] not in text and "--force" in text
    assert [h.stream for h in held(setup.settings, p4)] == streams(4)  # nothing changed

    read_up_to(p0=3)
    forced = setup.rescale(partitions=2, force=True)
    assert forced.removed == streams(4)[2:] and forced.dropped == {streams(4)[3]: 4}

    async def committed(stream: str):
        async with session(setup.settings) as nc:
            return await get_committed(nc, "resc", "raw", stream)

    assert asyncio.run(committed(streams(4)[0])) == 3
    # a removed partition's committed sequence goes with it: created again, it starts unread
    assert asyncio.run(committed(streams(4)[3])) is None


def test_the_cli_refuses_naming_the_stream_and_its_unread_count(setup):
    setup.provision(raw=4)
    publish(setup.settings, derived.edge_subject("resc", "in", "raw", 2), 4)
    path = write_spec(setup.folder, raw=2)
    cmd = [str(Path(sys.executable).parent / "isbflow"), "pipeline", "rescale", "-f", str(path), "--vertex", "raw",
           "--partitions", "2", "--data-dir", str(setup.server_dir)]  # the embedded server's: its settings
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "ISBFLOW_HOME")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{streams(4)[2]} (buffer in->raw, partition 2): 4 unread message(s)" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_vertex_whose_checkpoint_holds_state_is_refused_with_the_reason(setup):
    """The rule on a checkpoint laid out as Spark lays out a stateful query's (the real one, made by
    a running aggregation, is refused in tests/ops/test_rescale_pipeline.py)."""
    path, specs, p = setup.load(counts=2)
    ckpt = DataDir(setup.data_dir).checkpoint("resc", "counts", p.query_to("counts"))
    (ckpt / "state" / "0" / "0").mkdir(parents=True)
    (ckpt / "state" / "0" / "0" / "1.delta").write_bytes(b"x")
    with pytest.raises(ops.RescaleRefused, match="Spark cannot move a query's state") as e:
        ops.rescale(path, specs, p, "counts", setup.settings, setup.data_dir, partitions=2)
    assert "step 'counts' is an aggregation (output: update, keys ['service'])" in str(e.value)
    assert [h.partition for h in held(setup.settings, p, "counts")] == [0]  # nothing changed


def test_a_pipeline_running_without_a_launch_here_is_refused(setup):
    """A step heartbeating from a driver this host did not launch (a terminal's ``pipeline run``,
    another host): the rescale cannot drain and restart it, so it refuses and changes nothing."""

    async def beat():
        async with session(setup.settings) as nc:
            await put_status(nc, "resc", StepStatus("raw", state=Observed.RUNNING))

    asyncio.run(beat())
    with pytest.raises(ops.RescaleRefused, match=r"runs without a launch on this host \(step raw running"):
        setup.rescale(partitions=4)
    _, _, p = setup.load()
    assert [h.stream for h in held(setup.settings, p)] == streams(2)
