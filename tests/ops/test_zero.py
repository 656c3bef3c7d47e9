"""``isbflow pipeline scale-to-zero`` end to end: an idle pipeline's driver goes, new data brings it back.

Real nats-server (``nats_server``, its data dir is the pipeline's), real detached Spark drivers,
the watcher as the CLI runs it (a subprocess, stopped by PID). tests/specs/zero-mini.yaml lets
every vertex scale to zero after 2 s with nothing pending. The watcher starts the pipeline for
the events already published, drains it away once they are in the sink, starts it again when
more arrive, and the sink holds every event exactly once. Which pipelines may sleep, and when
one is idle, is tested without a server in tests/ops/test_zero_policy.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable
from typer.testing import CliRunner

from isbflow.cli import app
from isbflow.isb import provision
from isbflow.local.procs import process_alive
from isbflow.ops import pipeline as ops
from isbflow.ops.produce import produce
from isbflow.ops.zero import SLEEPING, watcher_record
from isbflow.spec import load_specs
from isbflow.spec.paths import DataDir
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

SPEC = ROOT / "tests" / "specs" / "zero-mini.yaml"


class Watcher:
    """``isbflow pipeline scale-to-zero --json`` in a subprocess; its decisions read from its output."""

    def __init__(self, data_dir: Path, out: Path, spec: Path = SPEC):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "REDIS_"))}  # the embedded server
        self.out = out
        with open(out, "wb") as f:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "isbflow"), "pipeline", "scale-to-zero", "-f", str(spec),
                 "--data-dir", str(data_dir), "--workdir", str(ROOT), "--json"],
                stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def events(self) -> list[dict]:
        out = []
        for line in self.out.read_text().splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    def wait_for(self, action: str, count: int, timeout: float) -> list[dict]:
        """The events once ``count`` of them are ``action`` (a stall guard, not a timing)."""
        deadline = time.monotonic() + timeout
        while True:
            events = self.events()
            if sum(e["action"] == action for e in events) >= count:
                return events
            assert self.proc.poll() is None, f"the watcher exited ({self.proc.returncode}):\n{self.out.read_text()}"
            assert time.monotonic() < deadline, f"no {action} #{count} in {timeout:.0f}s:\n{self.out.read_text()}"
            time.sleep(0.5)

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(timeout=60)


def commits(folder: Path) -> list[int]:
    return sorted(int(f.name) for f in folder.iterdir() if f.name.isdigit()) if folder.is_dir() else []


def sink_ids(data_dir: Path, pipeline: str = "zero") -> list[str]:
    return DeltaTable(str(data_dir / f"sinks/{pipeline}/raw")).to_pyarrow_table().column("_isb_id").to_pylist()


def publish(settings, p, count: int, start: int) -> None:
    assert asyncio.run(produce(settings, p, count=count, seed=3, start=start, malformed_every=None)).published == count


@pytest.mark.timeout(600)
def test_an_idle_pipeline_sleeps_without_its_driver_and_wakes_on_new_data(nats_server, tmp_path):
    data_dir, settings = nats_server.data_dir, nats_server.settings
    specs = load_specs([SPEC])
    p = specs.only_pipeline()
    asyncio.run(provision.apply(settings, specs))  # the source stream, to publish into
    first, more = 300, 200
    publish(settings, p, first, 0)

    watcher = Watcher(data_dir, tmp_path / "watcher.jsonl")
    try:
        # nothing runs and events are pending: the watcher starts the pipeline, then drains it away
        events = watcher.wait_for("asleep", 1, 300)
        woke = next(e for e in events if e["action"] == "awake")
        slept = next(e for e in events if e["action"] == "asleep")
        pid = woke["inputs"]["driver_pid"]
        assert slept["inputs"]["driver_pid"] == pid and not process_alive(pid)
        assert slept["inputs"]["final_offsets"]["in"] == {"src-zero-in": first}
        sleep = next(e for e in events if e["action"] == "sleep")
        assert all(n == 0 for n in sleep["inputs"]["pending"].values())  # the decision names its inputs
        source_commits = DataDir(data_dir).checkpoint("zero", "in", "raw") / "commits"
        kept = commits(source_commits)
        assert kept, "the source query's checkpoint is kept"
        assert sorted(sink_ids(data_dir)) == sorted(f"in/0/{i}" for i in range(1, first + 1))
        record = watcher_record(data_dir, "zero")
        assert record is not None and record["pid"] == watcher.proc.pid and record["state"] == "asleep"
        st = ops.status(settings, p)
        assert {v: s.state for v, s in st.statuses.items()} == {"in": SLEEPING, "raw": SLEEPING}
        shown = CliRunner().invoke(app, ["pipeline", "status", "-f", str(SPEC), "--data-dir", str(data_dir),
                                         "--json"], env={"NATS_URL": ""})
        assert shown.exit_code == 0, shown.output
        assert {v: s["state"] for v, s in json.loads(shown.output)["steps"].items()} == {"in": "sleeping",
                                                                                         "raw": "sleeping"}

        # new data on the source wakes it: a new driver reads from the checkpoints, loses nothing
        publish(settings, p, more, first)
        events = watcher.wait_for("asleep", 2, 300)
        awake = [e for e in events if e["action"] == "awake"]
        assert len(awake) == 2 and awake[1]["inputs"]["driver_pid"] != pid
        wake = [e for e in events if e["action"] == "wake"][-1]
        # the watcher wakes on the first new event it sees: how many of the new ones had landed by then
        # depends on the machine's load, all of them are read by the awoken driver (below)
        grown = wake["inputs"]["grown"]["src-zero-in"]
        assert set(wake["inputs"]["grown"]) == {"src-zero-in"} and grown["committed"] == first
        assert first < grown["last_seq"] <= first + more
        assert [e for e in events if e["action"] == "asleep"][1]["inputs"]["final_offsets"]["in"] == {
            "src-zero-in": first + more}
        assert not process_alive(awake[1]["inputs"]["driver_pid"])
        assert commits(source_commits)[:len(kept)] == kept and max(commits(source_commits)) > max(kept), (
            "the second driver goes on from the first one's checkpoint")
        ids = sink_ids(data_dir)
        assert len(ids) == len(set(ids)), "an event landed twice"
        assert set(ids) == {f"in/0/{i}" for i in range(1, first + more + 1)}

        # stopping the watcher leaves the pipeline drained, as a drain by hand would
        assert watcher.stop() == 0
        assert watcher.events()[-1]["action"] == "stopped"
        assert {s.state for s in ops.status(settings, p).statuses.values()} == {"drained"}
        assert watcher_record(data_dir, "zero") is None
    finally:
        watcher.stop()
        ops.stop_launch(data_dir, p, grace=20)  # whatever happened, no driver outlives the test
