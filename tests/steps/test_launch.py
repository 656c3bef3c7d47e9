"""``isbflow.steps.launch``: detached drivers, one live launch per pipeline, liveness by PID and heartbeats.

The launch mechanics run real detached processes (a sleeping Python stands in
for the Spark driver; the real driver is launched in tests/airflow/test_pipeline_operators.py);
every process started here is stopped by PID at teardown.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from isbflow.isb.connect import NatsSettings, resolve_settings
from isbflow.isb.state import Observed, StepStatus
from isbflow.steps import launch as L

SECRET = "pw-never-on-cmdline-17"
SETTINGS = NatsSettings(servers=("nats://isbflow:" + SECRET + "@127.0.0.1:4299",))
SLEEPER = [sys.executable, "-c", "import time; print('driver up', flush=True); time.sleep(300)"]


@pytest.fixture
def data_dir(tmp_path):
    yield tmp_path
    for rec in (tmp_path / "launches").glob("*.json"):
        r = L.LaunchRecord.from_json(json.loads(rec.read_text()))
        L.stop_process(r.pid, r.proc_start, grace=2)


def start(data_dir: Path, command=SLEEPER, statuses=None, **kw) -> L.LaunchRecord:
    return L.launch("demo", "demo", command, data_dir=data_dir, env=L.driver_env(SETTINGS, data_dir),
                    master="local[1]", statuses=statuses, **kw)


def wait_for(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def test_launch_is_detached_recorded_and_keeps_secrets_in_env(data_dir):
    rec = start(data_dir)

    assert not rec.reused and rec.alive() is True
    assert L.read_launch(data_dir, "demo") == rec
    assert Path(rec.log).parent == data_dir.absolute() / "logs"
    wait_for(lambda: "driver up" in Path(rec.log).read_text())
    stat = Path(f"/proc/{rec.pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    assert int(fields[2]) == rec.pid  # its own process group ...
    assert int(fields[3]) == rec.pid  # ... and session: detached from the caller
    cmdline = Path(f"/proc/{rec.pid}/cmdline").read_bytes().decode()
    environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{rec.pid}/environ").read_bytes().decode().split("\0")
                   if "=" in kv)
    assert SECRET not in cmdline and SECRET not in Path(rec.log).read_text()
    assert environ["NATS_PASSWORD"] == SECRET and SECRET not in environ["NATS_URL"]
    assert environ["ISBFLOW_HOME"] == str(data_dir.absolute())
    assert environ["PYSPARK_PYTHON"] == sys.executable and environ["SPARK_LOCAL_IP"] == "127.0.0.1"
    assert environ[L.LOG_ENV] == rec.log  # the driver bounds its own log (next test)


def test_a_launched_driver_rotates_its_own_log(data_dir):
    chatty = [sys.executable, "-c", "import sys, time\n"
              "from isbflow.steps.driver import cap_own_log\n"
              "cap_own_log(max_bytes=1000, interval=0.05)\n"
              "for i in range(20):\n    print('x' * 299, flush=True)\n"
              "time.sleep(0.5)\nprint('after', flush=True)\ntime.sleep(300)"]
    rec = start(data_dir, command=chatty)
    log = Path(rec.log)
    wait_for(lambda: "after" in log.read_text())
    rotated = log.with_name(log.name + ".1")
    assert rotated.exists() and 1000 < rotated.stat().st_size <= 6000  # one 6,000-byte burst at most
    assert log.stat().st_size < 1000  # the live part holds what came after the last rotation
    L.stop_process(rec.pid, rec.proc_start, grace=2)
    L.prune_logs(log.parent, "demo-[0-9a-f]{12}", keep=0)  # pruning removes a log with its rotated part
    assert not rotated.exists() and not log.exists()


def test_live_launch_is_reused_and_a_stopped_one_replaced(data_dir):
    first = start(data_dir)
    again = start(data_dir)
    assert again.reused and again.pid == first.pid and again.launch_id == first.launch_id

    stopped = L.stop_launch(data_dir, "demo", grace=5)
    assert stopped is not None and stopped.pid == first.pid
    assert first.alive() is False

    third = start(data_dir)
    assert not third.reused and third.pid != first.pid and third.alive() is True


def test_exited_driver_is_not_live(data_dir):
    rec = start(data_dir, command=[sys.executable, "-c", "print('bye')"])
    wait_for(lambda: rec.alive() is False)
    assert L.wait_exit(rec, 1)
    nxt = start(data_dir)
    assert not nxt.reused and nxt.launch_id != rec.launch_id


def test_pid_reuse_does_not_count_as_alive(data_dir):
    rec = start(data_dir)
    assert L.process_alive(rec.pid, rec.proc_start)
    assert not L.process_alive(rec.pid, (rec.proc_start or 0) + 1)


def test_stalled_driver_is_refused_not_doubled(data_dir):
    rec = start(data_dir)
    stale = StepStatus("in", state=Observed.RUNNING, pid=rec.pid)
    stale.updated_at = rec.started_at
    statuses = {"in": stale}
    later = rec.started_at + 500
    assert L.check_live(rec, statuses, heartbeat_timeout=60, startup_grace=300, now=rec.started_at + 100)
    with pytest.raises(L.LaunchStalled, match=rf"pid {rec.pid}\) still runs but sends no heartbeats"):
        L.check_live(rec, statuses, heartbeat_timeout=60, startup_grace=300, now=later)
    with pytest.raises(L.LaunchStalled):
        start(data_dir, statuses=statuses, startup_grace=0, heartbeat_timeout=0)
    fresh = StepStatus("in", state=Observed.RUNNING, pid=rec.pid)  # updated_at = now
    assert start(data_dir, statuses={"in": fresh}, startup_grace=0, heartbeat_timeout=60).reused


def test_judge_state(data_dir):
    rec = start(data_dir)
    now = time.time()

    def st(state, pid=rec.pid, at=now, error=None):
        s = StepStatus("x", state=state, pid=pid, error=error)
        s.updated_at = at
        return s

    ok = L.judge_state({"a": st("running"), "b": st("running")}, "running", rec, alive=True)
    assert ok.done and ok.problem is None and ok.steps == {"a": "running", "b": "running"}

    old = L.judge_state({"a": st("running", at=rec.started_at - 60), "b": st("running")}, "running", rec,
                        alive=True)
    assert not old.done and old.problem is None and old.steps["a"] == "unknown"  # an earlier run's heartbeat

    failed = L.judge_state({"a": st("failed", error="boom"), "b": None}, "running", rec, alive=True)
    assert not failed.done and "step 'a' failed: boom" in failed.problem

    dead = L.judge_state({"a": st("running"), "b": None}, "running", rec, alive=False)
    assert "exited before every step was running; waiting for b (unknown)" in dead.problem
    assert rec.log in dead.problem

    drained = L.judge_state({"a": st("drained")}, "drained", rec, alive=False)
    assert drained.done


def test_driver_command_and_settings_env(tmp_path, monkeypatch):
    cmd = L.driver_command("pipelines/logs.yaml", data_dir=tmp_path, master="local[2]", pipeline="logs")
    assert cmd[-8:] == ["--trigger", "continuous", "--master", "local[2]", "--data-dir", str(tmp_path.absolute()),
                        "--pipeline", "logs"]
    assert L.driver_command("x.yaml", data_dir=tmp_path, steps=["parse"])[1:4] == ["step", "run", "--step"]
    with pytest.raises(L.LaunchError, match="cannot launch steps a, b together"):
        L.driver_command("x.yaml", data_dir=tmp_path, steps=["a", "b"])
    fast = L.driver_command("x.yaml", data_dir=tmp_path, processing_time="200 milliseconds")
    assert fast[-2:] == ["--processing-time", "200 milliseconds"]
    assert "--processing-time" not in cmd  # default: the runner's interval
    for bad in ("--json", "1 second --x", "soon"):
        with pytest.raises(L.LaunchError, match="is not an interval"):
            L.driver_command("x.yaml", data_dir=tmp_path, processing_time=bad)

    tls = NatsSettings(servers=("tls://u:p@127.0.0.1:1",), tls_ca="/ca.pem")
    for original in (SETTINGS, tls, NatsSettings(servers=("nats://tok@h:1",))):
        env = L.settings_env(original)
        for k in [k for k in list(__import__("os").environ) if k.startswith("NATS_")]:
            monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert resolve_settings() == original.with_auth_from_urls()


def test_stop_process_leaves_a_reused_pid_alone():
    """A launch record that outlived its process (a crash, a reboot) names a PID another process
    may hold now: stop_process signals it only when its start time matches the record."""
    import subprocess

    from isbflow.local.procs import process_alive, process_start

    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        start = process_start(child.pid)
        assert start is not None
        L.stop_process(child.pid, proc_start=start + 1, grace=1.0)  # another process's record
        assert child.poll() is None and process_alive(child.pid, start)
        L.stop_process(child.pid, proc_start=start, grace=5.0)  # its own record
        assert child.wait(timeout=10) is not None
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_stop_process_kills_the_leftovers_of_its_group_and_never_a_group_that_took_its_number():
    """The leader is gone and its group lives on (a JVM whose driver died): its members are killed.
    A group that took the number after the leader ended (members started before the recorded
    leader cannot be its) is left alone: no whole-group kill on a number alone."""
    import signal
    import subprocess

    from isbflow.local.procs import group_members, process_alive, process_start

    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen(['sleep', '60']); print('up', flush=True); time.sleep(60)"],
                              start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert leader.stdout.readline().strip() == "up"
        start = process_start(leader.pid)
        (kid,) = [p for p in group_members(leader.pid) if p != leader.pid]
        os.kill(leader.pid, signal.SIGKILL)
        leader.wait(timeout=10)
        L.stop_process(leader.pid, proc_start=start + 10**9, grace=1.0)  # a record newer than the group
        time.sleep(0.5)  # a signal sent is delivered at once, but not before the call returns
        assert process_alive(kid), "a group the record cannot own was killed"
        L.stop_process(leader.pid, proc_start=start, grace=1.0)  # the group's own record
        deadline = time.monotonic() + 10
        while process_alive(kid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_alive(kid)
    finally:
        for p in group_members(leader.pid):
            os.kill(p, signal.SIGKILL)
        if leader.poll() is None:
            leader.kill()


def test_a_new_launch_keeps_only_the_newest_logs_of_its_key(data_dir):
    logs = data_dir.absolute() / "logs"
    logs.mkdir()
    old = [logs / f"demo-{i:012x}.log" for i in range(L.LOGS_KEPT + 3)]
    others = [logs / "demo-available-now-0123456789ab.log", logs / "demox-0123456789ab.log"]
    for i, p in enumerate([*old, *others]):
        p.write_text("old run\n")
        os.utime(p, (1_000_000 + i, 1_000_000 + i))

    rec = start(data_dir, command=[sys.executable, "-c", "print('bye')"])

    kept = sorted(p.name for p in logs.glob("demo-*.log") if p not in others)
    assert len(kept) == L.LOGS_KEPT and Path(rec.log).name in kept
    assert kept == sorted([Path(rec.log).name, *(p.name for p in old[-(L.LOGS_KEPT - 1):])])
    assert all(p.exists() for p in others)  # another key's, and batch runs', logs are theirs
