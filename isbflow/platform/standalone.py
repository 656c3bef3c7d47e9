"""A Spark standalone cluster on loopback, from the pyspark wheel: one master and N workers.

What a cluster deployment looks like, on one machine: the same
``org.apache.spark.deploy.master.Master`` / ``...worker.Worker`` classes a real
cluster runs, started with the wheel's ``bin/spark-class`` (no separate Spark
download). Tests and ``bench/scaling.py`` run pipelines against it with
``--master spark://127.0.0.1:<port>``; a PySpark driver always runs in client
mode there (standalone takes no Python application in cluster deploy mode).

Everything binds 127.0.0.1 (``--host`` and ``SPARK_LOCAL_IP``, which Spark's web
UIs bind to), on free ports picked here; the master's REST submission server is off. Each daemon leads its own process group
(its executors and their Python workers are its children, in that group), logs
to ``<work dir>/<name>.log``, and keeps its executors' files under
``<work dir>/<name>/`` (not the wheel's folder). :func:`stop_standalone` ends
each group by the PID recorded at start: SIGTERM, then SIGKILL after a grace.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from isbflow.ops.nats import free_port
from isbflow.ops.processes import process_alive as pid_alive

HOST = "127.0.0.1"
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


class StandaloneError(Exception):
    """The cluster could not start or did not become ready; the message names the daemon and its log."""


@dataclass
class Daemon:
    """One master or worker JVM: its name, PID (process group leader), log and web UI port."""

    name: str
    pid: int
    log: Path
    webui_port: int

    def alive(self) -> bool:
        return pid_alive(self.pid)


@dataclass
class StandaloneCluster:
    master_url: str
    master: Daemon
    workers: list[Daemon] = field(default_factory=list)
    work_dir: Path = Path(".")

    @property
    def master_ui(self) -> str:
        return f"http://{HOST}:{self.master.webui_port}"

    def master_state(self) -> dict:
        """The master's ``/json/`` page (status, workers, running applications)."""
        with urllib.request.urlopen(f"{self.master_ui}/json/", timeout=5) as r:
            return json.load(r)

    def alive_workers(self) -> int:
        try:
            state = self.master_state()
        except (urllib.error.URLError, OSError, ValueError):
            return 0
        return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")

    def daemons(self) -> list[Daemon]:
        return [self.master, *self.workers]


def spark_class() -> Path:
    """``bin/spark-class`` of the installed pyspark wheel."""
    import pyspark  # lazy: importing pyspark costs 0.3-1 s; `isbflow --help` imports this module

    path = Path(pyspark.__file__).parent / "bin" / "spark-class"
    if not path.exists():
        raise StandaloneError(f"{path} not found: is pyspark installed from its wheel?")
    return path


def daemon_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of the daemons: loopback binding and the venv's Python for executors' workers."""
    env = dict(os.environ if base is None else base)
    env.update({"SPARK_LOCAL_IP": HOST, "PYSPARK_PYTHON": sys.executable,
                "PYSPARK_DRIVER_PYTHON": sys.executable,
                "PATH": str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")})
    return env


def _spawn(name: str, args: list[str], work_dir: Path, env: dict[str, str], webui_port: int) -> Daemon:
    log = work_dir / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(spark_class()), *args], env=env, cwd=work_dir, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Daemon(name, proc.pid, log, webui_port)


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def start_standalone(work_dir: Path | str, workers: int = 1, cores: int = 1, memory: str = "1g",
                     timeout: float = 120.0, env: dict[str, str] | None = None) -> StandaloneCluster:
    """Start a master and ``workers`` workers (``cores`` and ``memory`` each); return when every
    worker is registered ALIVE with the master. On failure stops what it started and raises
    :class:`StandaloneError` with the failing daemon's log tail."""
    work_dir = Path(work_dir).absolute()
    work_dir.mkdir(parents=True, exist_ok=True)
    denv = daemon_env(env)
    port, ui = free_port(), free_port()
    # no REST submission server (port 6066, unauthenticated): drivers here run in client mode
    master = _spawn("master", [MASTER_CLASS, "--host", HOST, "--port", str(port), "--webui-port", str(ui)],
                    work_dir, {**denv, "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false"}, ui)
    cluster = StandaloneCluster(f"spark://{HOST}:{port}", master, [], work_dir)
    try:
        for i in range(workers):
            name = f"worker-{i + 1}"
            wdir = work_dir / name
            wdir.mkdir(exist_ok=True)
            wui = free_port()
            cluster.workers.append(_spawn(name, [
                WORKER_CLASS, cluster.master_url, "--host", HOST, "--port", str(free_port()),
                "--webui-port", str(wui), "--cores", str(cores), "--memory", memory, "--work-dir", str(wdir),
            ], work_dir, {**denv, "SPARK_WORKER_DIR": str(wdir)}, wui))
        deadline = time.monotonic() + timeout
        while cluster.alive_workers() < workers:
            dead = next((d for d in cluster.daemons() if not d.alive()), None)
            if dead is not None:
                raise StandaloneError(f"Spark {dead.name} exited; log {dead.log}:\n{_tail(dead.log)}")
            if time.monotonic() > deadline:
                raise StandaloneError(
                    f"{cluster.alive_workers()} of {workers} Spark worker(s) registered with {cluster.master_url} "
                    f"after {timeout:.0f}s; master log {master.log}:\n{_tail(master.log)}")
            time.sleep(0.5)
    except BaseException:
        stop_standalone(cluster)
        raise
    return cluster


def stop_daemon(daemon: Daemon, grace: float = 20.0) -> None:
    """SIGTERM the daemon's process group (its executors with it), SIGKILL what is left after ``grace``."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(daemon.pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and daemon.alive():
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(daemon.pid, os.WNOHANG)  # reap our own child
            time.sleep(0.1)
        if not daemon.alive():
            break
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(daemon.pid, signal.SIGKILL)  # executors that outlived their worker


def stop_standalone(cluster: StandaloneCluster, grace: float = 20.0) -> None:
    """Stop the workers, then the master, each by its recorded PID."""
    for d in [*reversed(cluster.workers), cluster.master]:
        stop_daemon(d, grace)
