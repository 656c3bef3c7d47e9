"""The platform's lifecycle as ``make run`` runs it (``isbflow platform up`` in the foreground).

One scenario on one data dir, in order:

1. ``up`` starts NATS, Airflow and the demo: every step runs, the raw sink grows, the
   reference table is loaded, ``pipeline_quality`` is unpaused, and every socket the
   platform's processes listen on is on 127.0.0.1;
2. ``up`` again reuses it: same processes, same driver, same producer, nothing doubled;
3. Ctrl-C (SIGINT to the foreground ``up``) drains the pipeline, then stops every process:
   none of the recorded PIDs lives, none of their ports listens, and the raw sink holds
   every event the source holds (the drain lost nothing);
4. ``up`` once more reuses the state (same admin password, the producer continues after
   the last event), and ``isbflow platform down`` from another shell drains and stops it.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import psutil
import pytest

from isbflow import platform
from isbflow.isb import server as nats_server
from isbflow.platform.procs import marked_processes
from isbflow.steps import launch as launcher
from tests.helpers.live_platform import (
    PROCESSING_TIME,
    ROOT,
    Api,
    Scenario,
    alive,
    all_pids,
    cli,
    delta_ids,
    delta_rows,
    listening,
    loopback,
    ports_held_by,
    status,
    steps_running,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SPEC = ROOT / "pipelines" / "logs.yaml"
PIPELINE = "logs"


@pytest.fixture(scope="module")
def scenario(demo_platform) -> Scenario:
    """The session's platform (tests/e2e/conftest.py); this module stops it (a failed test too: the
    suite's later folders must not run beside a live platform)."""
    try:
        yield demo_platform
    finally:
        demo_platform.stop_all()


def drivers_and_producers(data_dir: Path) -> tuple[list[int], list[int]]:
    """PIDs of the 'isbflow pipeline run' and 'isbflow produce' processes working on ``data_dir``."""
    drivers, producers = [], []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if str(data_dir) not in cmd or len(cmd) < 3:
            continue
        if "pipeline" in cmd and "run" in cmd:
            drivers.append(p.pid)
        elif "produce" in cmd:
            producers.append(p.pid)
    return drivers, producers


def test_up_runs_the_demo_on_loopback(scenario):
    up = scenario.first()
    d = scenario.data_dir
    out = up.text()
    assert f"http://127.0.0.1:{scenario.port}" in out, out
    printed = re.search(r"login: admin, password in (\S+) ", out)
    assert printed and Path(printed.group(1)).samefile(d / "airflow" / platform.PASSWORD_FILE), out
    assert platform.admin_password(d / "airflow") not in out, "the admin password is pointed at, never printed"
    assert "producer     200 events/s" in out and "from event 0" in out, out

    wait_for(lambda: steps_running(d), 300, "every step of the demo to run")
    st = wait_for(lambda: (s := status(d))["running"] and s, 120, "the platform's status to say running")
    assert st["supervised"], st
    assert st["producer"]["alive"] and st["producer"]["rate"] == 200, st["producer"]
    assert st["pipeline"]["launch"]["alive"], st["pipeline"]
    cmd = psutil.Process(launcher.read_launch(d, PIPELINE).pid).cmdline()  # --processing-time reached the driver
    assert cmd[cmd.index("--processing-time") + 1] == PROCESSING_TIME, cmd
    # CPU and memory per process (platform status prints both)
    live = [*st["processes"], st["producer"], st["pipeline"]["launch"]]
    assert all(p["cpu_pct"] >= 0 and p["pss_mb"] > 0 for p in live), live
    assert len(st["nats"]["cpu_pct"]) == len(st["nats"]["nodes"]), st["nats"]

    first = wait_for(lambda: delta_rows(scenario.raw), 300, "the raw sink's first commit")
    wait_for(lambda: delta_rows(scenario.raw) > first, 240, f"the raw sink to grow past {first} rows")

    ref = cli("ref", "load", "-f", str(SPEC), "--name", "services", "--json", data_dir=d, check=True)
    assert '"api-gateway"' in ref.stdout and ref.stdout.count('"team"') == 8, ref.stdout

    state = platform.read_state(d)
    api = Api(state.url, platform.admin_password(Path(state.airflow_home)))
    assert api("GET", "dags/pipeline_quality")["is_paused"] is False

    socks = listening(all_pids(state))
    assert ("127.0.0.1", scenario.port) in socks and any(p == scenario.nats_port for _, p in socks), socks
    assert [s for s in socks if not loopback(s[0])] == [], f"sockets not on 127.0.0.1: {socks}"


def test_up_again_reuses_the_running_platform(scenario):
    d = scenario.data_dir
    before = platform.read_state(d)
    launch = launcher.read_launch(d, PIPELINE)
    again = cli(*scenario.up_args(), data_dir=d, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "isbflow platform already runs" in again.stdout, again.stdout
    assert f"Already supervised by pid {scenario.ups[0].proc.pid}" in again.stdout, again.stdout
    assert "already running" in again.stdout, again.stdout  # the driver and the producer were found

    after = platform.read_state(d)
    assert [p.pid for p in after.processes] == [p.pid for p in before.processes]
    assert after.producer.pid == before.producer.pid and after.marker == before.marker
    relaunch = launcher.read_launch(d, PIPELINE)
    assert (relaunch.launch_id, relaunch.pid) == (launch.launch_id, launch.pid)
    drivers, producers = drivers_and_producers(d)
    assert drivers == [launch.pid] and producers == [before.producer.pid], (drivers, producers)


def test_ctrl_c_drains_then_stops_every_process(scenario):
    up = scenario.ups[0]
    d = scenario.data_dir
    state = platform.read_state(d)
    pids = all_pids(state)
    ports = {port for _, port in listening(pids)}
    assert len(pids) > 10 and ports, (pids, ports)

    up.proc.send_signal(signal.SIGINT)  # what Ctrl-C in its terminal does
    assert up.proc.wait(timeout=600) == 0, up.text()[-4000:]
    out = up.text()
    assert f"pipeline {PIPELINE}: drained" in out, out[-4000:]
    assert "nats-server" in out.splitlines()[-1], out[-2000:]
    assert alive(pids) == set(), f"still running after Ctrl-C: {alive(pids)}"
    marked = set(marked_processes(state.marker))
    assert marked == set(), f"processes carrying the platform's marker still run after Ctrl-C: {marked}"
    held = ports_held_by(ports, pids | marked)
    assert held == {}, f"ports still listened on by the platform's processes after Ctrl-C: {held}"
    assert platform.read_state(d) is None

    # nothing the source holds is missing from the raw sink (or the dead letters), nothing twice
    nats_server.start_embedded(d, client_port=scenario.nats_port)
    try:
        source, dlq = scenario.source_and_dlq()
    finally:
        nats_server.stop_embedded(d)
    ids = delta_ids(scenario.raw)
    assert len(ids) == len(set(ids)), "duplicate _isb_id in the raw sink"
    assert source > 0 and len(ids) + dlq == source, f"raw {len(ids)} + dead letters {dlq} != source {source}"
    scenario.notes["source"] = source
    scenario.notes["rows"] = len(ids)


def test_up_after_stop_reuses_state_and_down_stops_it(scenario):
    d = scenario.data_dir
    password = platform.admin_password(d / "airflow")
    up = scenario.start("second")
    out = up.text()
    assert password and password not in out, "the admin password is pointed at, never printed"
    printed = re.search(r"login: admin, password in (\S+) ", out)
    assert printed and Path(printed.group(1)).samefile(d / "airflow" / platform.PASSWORD_FILE), out
    assert "source" in scenario.notes, "test_ctrl_c_drains_then_stops_every_process did not get to its end"
    assert f"from event {scenario.notes['source']:,}" in out, out  # the producer continues, no id reused
    assert re.search(r"buffers: (\d+) streams/buckets \(\1 unchanged\)", out), out  # the buffers were kept

    wait_for(lambda: steps_running(d), 300, "every step to run again")
    rows = scenario.notes["rows"]
    wait_for(lambda: delta_rows(scenario.raw) > rows, 300, f"the raw sink to grow past {rows} rows")

    state = platform.read_state(d)
    pids = all_pids(state)
    ports = {port for _, port in listening(pids)}
    down = cli("platform", "down", data_dir=d, timeout=700)
    assert down.returncode == 0, down.stdout + down.stderr
    assert up.proc.wait(timeout=60) == 0, up.text()[-4000:]
    assert f"pipeline {PIPELINE}: drained" in up.text(), up.text()[-4000:]
    assert alive(pids) == set(), f"still running after 'platform down': {alive(pids)}"
    marked = set(marked_processes(state.marker))
    assert marked == set(), f"processes carrying the platform's marker still run after 'platform down': {marked}"
    held = ports_held_by(ports, pids | marked)
    assert held == {}, f"ports still listened on by the platform's processes after 'platform down': {held}"
    st = status(d)
    assert st["running"] is False and st["processes"] == [], st
