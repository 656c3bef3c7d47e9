"""The scale-to-zero watcher's asleep side against a real nats-server, with no Spark.

The wake is event-driven: the source stream's RePublish wakes the watcher (no poll), and it
starts the pipeline. Here the start is the one stand-in: a sleeping Python process launched and
recorded as the driver (tests/ops/test_zero.py starts the real driver, drains it and wakes it on
the real pipeline). Someone else's verbs win: a start by hand makes the watcher awake, a drain by
hand ends the watch with the steps reading drained. Watchers run in a thread, stopped by an event;
every process started is stopped by PID.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from isbflow.isb import provision
from isbflow.isb.connect import session
from isbflow.isb.state import Desired, set_desired
from isbflow.local.procs import process_alive
from isbflow.ops import pipeline as ops
from isbflow.ops import zero, zero_policy
from isbflow.ops.produce import produce
from isbflow.ops.zero_launch import launch_watcher, stop_watcher
from isbflow.spec import load_specs
from isbflow.steps import launch as L

SPEC = Path(__file__).resolve().parent.parent / "specs" / "zero-mini.yaml"
SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


class Run:
    """A watcher in a thread over the test's server, its events, and the stand-in driver it starts."""

    def __init__(self, nats_server, monkeypatch):
        self.settings, self.data_dir = nats_server.settings, nats_server.data_dir
        self.specs = load_specs([SPEC])
        self.p = self.specs.only_pipeline()
        asyncio.run(provision.apply(self.settings, self.specs))
        self.events: list[zero.ZeroEvent] = []
        self.starts: list[float] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        monkeypatch.setattr(zero.ops_pipeline, "start", self.start_driver)
        self.thread = threading.Thread(target=self.run, daemon=True)

    def start_driver(self, spec_file, specs, p, settings, data_dir, **kw):
        self.starts.append(time.monotonic())
        record = L.launch(p.name, p.name, SLEEPER, data_dir=data_dir, env=dict(os.environ))
        return SimpleNamespace(launch=record)

    def run(self) -> None:
        try:
            zero.watch(SPEC, self.specs, self.p, self.settings, self.data_dir, stop=self.stop,
                       on_event=self.events.append)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            self.error = e

    def wait(self, action: str, timeout: float = 30.0) -> zero.ZeroEvent:
        deadline = time.monotonic() + timeout
        while not any(e.action == action for e in self.events):
            assert self.error is None, repr(self.error)
            assert time.monotonic() < deadline, f"no {action}: {[e.line() for e in self.events]}"
            time.sleep(0.05)
        return next(e for e in self.events if e.action == action)

    def states(self) -> dict[str, str]:
        return {v: s.state for v, s in ops.status(self.settings, self.p).statuses.items()}

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the watcher did not stop"
        L.stop_launch(self.data_dir, self.p.name, grace=5)


@pytest.fixture
def run(nats_server, monkeypatch):
    r = Run(nats_server, monkeypatch)
    try:
        yield r
    finally:
        r.finish()


def test_asleep_the_watcher_is_woken_by_the_source_stream_and_starts_the_pipeline(run, monkeypatch):
    # no peek and no control check for an hour: only the stream's own wake can start the pipeline
    hour = zero_policy.ZeroPolicy(idle_seconds=2, peek_seconds=3600, look_seconds=1)
    monkeypatch.setattr(zero, "policy", lambda p: hour)
    monkeypatch.setattr(zero, "CONTROL_EVERY", 3600.0)
    run.thread.start()
    asleep = run.wait("asleep")
    assert asleep.inputs["pending"] == {"isb-zero-in-raw-0": 0, "src-zero-in": 0}
    assert run.states() == {"in": zero.SLEEPING, "raw": zero.SLEEPING}
    time.sleep(1)  # asleep a while: nothing starts without data
    assert not run.starts

    published = time.monotonic()
    assert asyncio.run(produce(run.settings, run.p, count=3, seed=1, malformed_every=None)).published == 3
    wake = run.wait("wake")
    assert wake.inputs["grown"] == {"src-zero-in": {"committed": 0, "last_seq": 3}}
    awake = run.wait("awake")
    assert L.read_launch(run.data_dir, "zero").pid == awake.inputs["driver_pid"]
    print(f"new data seen and the start called {run.starts[0] - published:.3f}s after the publish")

    run.stop.set()
    run.thread.join(30)
    assert run.events[-1].action == "stopped" and "keeps running" in run.events[-1].reason
    assert L.read_launch(run.data_dir, "zero").alive()  # the watcher leaves a running pipeline running


def test_a_start_by_hand_wakes_the_watcher_and_a_drain_by_hand_ends_the_watch(run, monkeypatch):
    monkeypatch.setattr(zero, "CONTROL_EVERY", 0.5)  # asleep, look for someone else's verbs twice a second
    run.thread.start()
    run.wait("asleep")
    record = L.launch("zero", "zero", SLEEPER, data_dir=run.data_dir, env=dict(os.environ))  # started by hand
    awake = run.wait("awake", timeout=zero.CONTROL_EVERY * 3)
    assert "started by someone else" in awake.reason and not run.starts
    L.stop_process(record.pid, record.proc_start, grace=5)
    run.stop.set()
    run.thread.join(30)

    # a drain by hand while asleep: the watch ends, the steps read drained for the drain to see
    again = Run.__new__(Run)
    again.__dict__.update(run.__dict__, events=[], stop=threading.Event(), error=None)
    again.thread = threading.Thread(target=again.run, daemon=True)
    again.thread.start()
    again.wait("asleep")

    async def drain_by_hand() -> None:
        async with session(run.settings) as nc:
            await set_desired(nc, "zero", "in", Desired.DRAINING)

    asyncio.run(drain_by_hand())
    stopped = again.wait("stopped", timeout=zero.CONTROL_EVERY * 3)
    assert "someone drains" in stopped.reason and stopped.inputs["desired"]["in"] == "draining"
    again.thread.join(30)
    assert again.error is None and not again.thread.is_alive()
    assert again.states() == {"in": "drained", "raw": "drained"}
    assert zero.watcher_record(run.data_dir, "zero") is None


def test_one_watcher_per_pipeline(run):
    run.thread.start()
    run.wait("asleep")
    with pytest.raises(zero.WatcherBusy, match=rf"already has a scale-to-zero watcher \(pid {os.getpid()}, asleep\)"):
        zero.watch(SPEC, run.specs, run.p, run.settings, run.data_dir, stop=threading.Event())


def test_a_detached_watcher_is_recorded_reused_and_stopped_by_pid(nats_server):
    """The watcher as a face other than the CLI starts it (the ``pipeline_scale_to_zero`` DAG):
    a real ``isbflow pipeline scale-to-zero`` process, detached, its settings in its environment."""
    settings, data_dir = nats_server.settings, nats_server.data_dir
    specs = load_specs([SPEC])
    p = specs.only_pipeline()
    asyncio.run(provision.apply(settings, specs))
    first = launch_watcher(SPEC, p, settings, data_dir)
    try:
        assert not first.reused and process_alive(first.pid, first.proc_start)
        again = launch_watcher(SPEC, p, settings, data_dir)
        assert again.reused and again.pid == first.pid
        deadline = time.monotonic() + 60
        while (zero.watcher_record(data_dir, "zero") or {}).get("state") != "asleep":
            assert time.monotonic() < deadline, Path(first.log).read_text()
            time.sleep(0.2)
        cmdline = Path(f"/proc/{first.pid}/cmdline").read_bytes().decode()
        assert nats_server.state.password not in cmdline  # the settings travel in its environment
        assert stop_watcher(data_dir, "zero", grace=20) == first.pid
        assert not process_alive(first.pid, first.proc_start)
        assert "the watcher stopped; the pipeline stays drained" in Path(first.log).read_text()
        assert {s.state for s in ops.status(settings, p).statuses.values()} == {"drained"}
        assert stop_watcher(data_dir, "zero") is None
    finally:
        L.stop_process(first.pid, first.proc_start, grace=5)
