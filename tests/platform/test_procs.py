"""The platform's stop path signals a recorded PID only while it still names the process recorded.

Each test starts a ``sleep 60`` child leading its own session (as the platform starts its
processes), records it in a platform state file, and runs :func:`isbflow.platform.stop`: a
record whose start time differs from the live process's (the kernel reused the PID) leaves
the process alone; a matching record, or one without a start time (an older state file),
stops it. The child is always cleaned up by its PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from isbflow import platform
from isbflow.ops.processes import process_alive, process_start
from isbflow.platform.procs import reused


@pytest.fixture
def child() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def record(data_dir: Path, pid: int, proc_start: int | None, as_producer: bool = False) -> None:
    """A platform state file naming ``pid`` as an Airflow component (or the producer)."""
    proc = platform.ProcessState("sleeper", pid, str(data_dir / "sleeper.log"), proc_start)
    state = platform.PlatformState(str(data_dir), str(data_dir / "airflow"), 1, str(data_dir / "dags"),
                                   supervisor_pid=0, nats_started=False,
                                   processes=[] if as_producer else [proc],
                                   producer=proc if as_producer else None)
    platform.write_state(state)


def started(proc: subprocess.Popen) -> int:
    start = process_start(proc.pid)
    assert start is not None
    return start


@pytest.mark.parametrize("as_producer", [False, True], ids=["airflow-process", "producer"])
def test_stop_leaves_a_reused_pid_alone(tmp_path, child, as_producer):
    record(tmp_path, child.pid, started(child) + 1, as_producer)
    assert reused(child.pid, started(child) + 1)

    report = platform.stop(tmp_path, grace=2.0)

    assert report is not None and report.leftovers == []
    assert child.poll() is None and process_alive(child.pid), "stop signalled a PID recorded for another process"
    assert platform.read_state(tmp_path) is None


@pytest.mark.parametrize("proc_start", ["recorded", None], ids=["same-start-time", "no-start-time"])
def test_stop_stops_the_recorded_process(tmp_path, child, proc_start):
    record(tmp_path, child.pid, started(child) if proc_start else None)

    t0 = time.monotonic()
    platform.stop(tmp_path, grace=5.0)

    child.wait(timeout=5)  # stop reaped it (its status is gone) or left it to us
    assert not process_alive(child.pid)
    assert time.monotonic() - t0 < 10  # SIGTERM was enough: no grace spent waiting


def test_state_keeps_start_times_and_checks_the_supervisor(tmp_path, child):
    record(tmp_path, child.pid, started(child))
    state = platform.read_state(tmp_path)
    assert state is not None and state.processes[0].proc_start == started(child)
    assert state.processes[0].alive()

    platform.adopt(state, child.pid)
    again = platform.read_state(tmp_path)
    assert again is not None and again.supervisor_start == started(child) and again.supervised()

    again.supervisor_start = started(child) + 1  # the supervisor's PID now names another process
    assert not again.supervised() and not platform.ProcessState("x", child.pid, "", started(child) + 1).alive()
    again.supervisor_start = None  # an older state file: trusted by PID
    assert again.supervised()


def test_group_cpu_is_measured_per_process_group(child):
    """A busy process group shows its CPU and an idle one (``child`` sleeps) shows next to none:
    what ``isbflow platform status`` prints per process."""
    from isbflow.platform.procs import group_cpu_seconds, groups_cpu_percent

    busy = subprocess.Popen(["python3", "-c", "import time\nend = time.time() + 30\nwhile time.time() < end: pass"],
                            start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        pct = groups_cpu_percent([busy.pid, child.pid], interval=1.0)
        assert pct[busy.pid] > 10.0 + pct[child.pid], pct
        assert group_cpu_seconds(busy.pid) > 0.0
        assert group_cpu_seconds(99_999_999) == 0.0  # no such group: nothing, not an error
    finally:
        busy.kill()
        busy.wait(timeout=10)
