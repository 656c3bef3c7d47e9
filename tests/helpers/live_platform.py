"""Helpers for the tests that run the whole platform (``test_platform.py``, ``test_browser.py``).

They look at the platform from outside, the way a user would check it: processes by
PID, listening sockets, the Delta sinks, the buffers and the Airflow REST API.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil

from isbflow import platform
from isbflow.isb import naming
from isbflow.isb import server as nats_server

ROOT = Path(__file__).resolve().parents[2]
ISBFLOW = str(Path(sys.executable).parent / "isbflow")
#: every step's trigger interval on the tests' live platform (``platform up --processing-time``):
#: the demo's seven queries at 200 events/s cost ~0.7 of a core at 5 s and ~0.3 at 15 s (driver
#: tree, 60 s windows); the platform lives ~10 minutes of the suite, and the tests only need
#: records to keep arriving (the first raw commit still comes seconds after "is up")
PROCESSING_TIME = "15 seconds"
T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float, what: str, every: float = 2.0) -> T:
    """Poll ``check`` until it returns something truthy; AssertionError naming ``what`` (and the
    last value seen) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r}")
        time.sleep(every)


def cli(*args: str, data_dir: Path, timeout: float = 120.0, check: bool = False) -> subprocess.CompletedProcess:
    """Run ``isbflow <args> --data-dir <data_dir>`` and return its result (text)."""
    proc = subprocess.run([ISBFLOW, *args, "--data-dir", str(data_dir)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=subprocess_env())
    if check and proc.returncode != 0:
        raise AssertionError(f"isbflow {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def _terminal_signals() -> None:
    """SIGINT as a terminal's foreground process has it: a suite started in the background of a
    non-interactive shell (``make test &``, ``nohup``) inherits SIGINT ignored, and then the Ctrl-C
    test's SIGINT would do nothing (seen: 600 s waiting for a drain that never started)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def subprocess_env() -> dict[str, str]:
    """The environment for platform subprocesses: no outer NATS_URL/ISBFLOW_HOME/Airflow settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW", "NATS_")) and k != "ISBFLOW_HOME"}
    env.update({"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
                "SPARK_LOCAL_IP": "127.0.0.1", "COLUMNS": "200"})
    return env


def status(data_dir: Path) -> dict:
    """``isbflow platform status --json``."""
    return json.loads(cli("platform", "status", "--json", data_dir=data_dir).stdout)


def status_here(data_dir: Path) -> dict:
    """What ``isbflow platform status --json`` prints (the same function, JSON round trip), read in
    the test process: for polling loops, where a CLI process every few seconds (~1.5 CPU-seconds
    each) would cost more than the platform being watched."""
    return json.loads(json.dumps(platform.status(Path(data_dir).resolve()), default=str))


def steps_running(data_dir: Path) -> dict[str, int] | None:
    """Each step's batch id when every step of the platform's pipeline reports ``running`` and
    has finished a micro-batch, else None (polled in-process: :func:`status_here`)."""
    st = status_here(data_dir)
    steps = (st.get("pipeline") or {}).get("steps") or {}
    ok = steps and all(s and s["state"] == "running" and s["batch_id"] >= 0 for s in steps.values())
    return {v: s["batch_id"] for v, s in steps.items()} if ok else None


def all_pids(state: platform.PlatformState) -> set[int]:
    """Every live process of the platform, nats-server included."""
    from isbflow.isb import server

    pids = set(platform.platform_processes(state))
    nats = server.read_state(Path(state.data_dir))
    if nats is not None:
        pids |= {n.pid for n in nats.nodes if server.pid_alive(n.pid)}
    return pids


def listening(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the processes ``pids`` listen on."""
    out = set()
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        out |= {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    return out


def loopback(ip: str) -> bool:
    return ip in ("127.0.0.1", "::ffff:127.0.0.1")


def port_owners(port: int) -> set[int]:
    """PIDs of the processes listening on TCP ``port`` (any address; -1 when the owner is not known)."""
    return {c.pid if c.pid is not None else -1 for c in psutil.net_connections(kind="inet")
            if c.laddr.port == port and c.status == psutil.CONN_LISTEN}


def ports_held_by(ports: set[int], ours: set[int]) -> dict[int, set[int]]:
    """Of ``ports``, those still listened on by a process of ``ours`` (or by one whose owner is unknown).

    A port a stopped platform released may be taken at once by another test's process on the same
    machine (Spark's UI takes 4040 or the next free one): that one is not a leak."""
    held = {}
    for port in ports:
        owners = port_owners(port)
        if owners & (ours | {-1}):
            held[port] = owners
    return held


def alive(pids: set[int]) -> set[int]:
    """The PIDs of ``pids`` still running (zombies count as gone)."""
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.Error:
            pass
    return out


def delta_rows(path: Path) -> int:
    """Rows in the Delta table at ``path`` (0 before its first commit)."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        return DeltaTable(str(path)).to_pyarrow_dataset().count_rows()
    except TableNotFoundError:
        return 0


def delta_ids(path: Path) -> list[str]:
    from deltalake import DeltaTable

    return DeltaTable(str(path)).to_pyarrow_dataset().to_table(columns=["_isb_id"]).column(0).to_pylist()


class Api:
    """The Airflow REST API as ``admin`` (a token from ``POST /auth/token``)."""

    def __init__(self, url: str, password: str):
        self.url = url
        body = json.dumps({"username": platform.ADMIN, "password": password}).encode()
        req = urllib.request.Request(f"{url}/auth/token", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            self.token = json.loads(r.read())["access_token"]

    def __call__(self, method: str, path: str, body: dict | None = None) -> Any:
        req = urllib.request.Request(f"{self.url}/api/v2/{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
        return json.loads(raw) if raw else None

    def trigger(self, dag_id: str, run_id: str, conf: dict) -> dict:
        return self("POST", f"dags/{dag_id}/dagRuns", {"dag_run_id": run_id, "logical_date": None, "conf": conf})

    def run_state(self, dag_id: str, run_id: str) -> str:
        return self("GET", f"dags/{dag_id}/dagRuns/{run_id}")["state"]

    def wait_run(self, dag_id: str, run_id: str, timeout: float) -> str:
        """The run's terminal state (success or failed)."""
        return wait_for(lambda: (s := self.run_state(dag_id, run_id)) in ("success", "failed") and s,
                        timeout, f"DAG run {dag_id}/{run_id} to finish", every=3.0)

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> str:
        """The task's log as text (for failure messages)."""
        try:
            out = self("GET", f"dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}")
        except Exception as e:  # noqa: BLE001 - only used to explain another failure
            return f"(no log: {e})"
        content = out.get("content") if isinstance(out, dict) else out
        if isinstance(content, list):
            return "\n".join(c.get("event", str(c)) if isinstance(c, dict) else str(c) for c in content)[-6000:]
        return str(content)[-6000:]

    def xcom(self, dag_id: str, run_id: str, task_id: str) -> Any:
        out = self("GET", f"dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value"
                          "?deserialize=true")
        return out["value"]


SPEC = ROOT / "pipelines" / "logs.yaml"
PIPELINE = "logs"


@dataclass
class Up:
    """One foreground ``isbflow platform up`` and its output file."""

    proc: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Scenario:
    data_dir: Path
    port: int
    nats_port: int
    ups: list[Up] = field(default_factory=list)
    notes: dict = field(default_factory=dict)

    @property
    def raw(self) -> Path:
        return self.data_dir / "sinks" / "logs" / "raw"

    def up_args(self) -> list[str]:
        # a 5 s trigger: the demo at its spec's 1 s costs ~1.9 cores of this 2-core machine, at 5 s ~1.15
        # (measured with `isbflow platform up`, steady state), and these tests only read the running platform
        return ["platform", "up", "--port", str(self.port), "--nats-port", str(self.nats_port), "--rate", "200",
                "--processing-time", PROCESSING_TIME]

    def stop_all(self) -> None:
        """Whatever is left: the foreground 'up's (SIGTERM, then SIGKILL), then the platform, by PID."""
        for up in self.ups:
            if up.proc.poll() is None:
                up.proc.send_signal(signal.SIGTERM)
                try:
                    up.proc.wait(timeout=400)
                except subprocess.TimeoutExpired:
                    os.killpg(up.proc.pid, signal.SIGKILL)
                    up.proc.wait()
        platform.stop(self.data_dir, drain_timeout=60)
        nats_server.stop_embedded(self.data_dir)

    def first(self) -> Up:
        """The first foreground ``up``, started by whichever test needs the platform first; the
        later readers share it (one platform start for the browser and lifecycle tests)."""
        if not self.ups:
            self.start("first")
        return self.ups[0]

    def start(self, name: str) -> Up:
        """Start ``up`` in its own session (as a terminal would run it) and wait for its summary."""
        log = self.data_dir.parent / f"up-{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([ISBFLOW, *self.up_args(), "--data-dir", str(self.data_dir)], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                    env=subprocess_env(), start_new_session=True, preexec_fn=_terminal_signals)
        up = Up(proc, log)
        self.ups.append(up)
        wait_for(lambda: "isbflow platform is up" in up.text() or proc.poll() is not None, 600,
                 f"'isbflow platform up' ({name}) to print its summary")
        assert proc.poll() is None, f"'isbflow platform up' exited {proc.returncode}:\n{up.text()[-4000:]}"
        return up

    def source_and_dlq(self) -> tuple[int, int]:
        """Messages in the demo's source stream and its dead-letter stream (NATS must run)."""
        import asyncio

        from isbflow.isb.connect import connect, resolve_settings
        from isbflow.spec import load_specs

        p = load_specs([SPEC]).pipelines[PIPELINE]

        async def go() -> tuple[int, int]:
            nc = await connect(resolve_settings(data_dir=self.data_dir))
            try:
                js = nc.jetstream()
                src = await js.stream_info(naming.source_stream(p, "in"))
                dlq = await js.stream_info(naming.dlq_stream(PIPELINE))
                return int(src.state.messages), int(dlq.state.messages)
            finally:
                await nc.close()

        return asyncio.run(go())


def demo_scenario(tmp_path_factory) -> Iterator[Scenario]:
    """The generator behind the session fixture ``demo_platform`` (tests/e2e/conftest.py): one data
    dir and free ports; at the end, :meth:`Scenario.stop_all`."""
    box = tmp_path_factory.mktemp("platform")
    s = Scenario(box / "data", nats_server.free_port(), nats_server.free_port())
    try:
        yield s
    finally:
        s.stop_all()
