"""Spark's Python processes forked from one warm process instead of started cold.

Spark starts a fresh Python process for every streaming query that reads a Python data source
(``python -m pyspark.sql.streaming.python_streaming_source_runner``: Spark 4 starts it directly,
not through its forking daemon), and one daemon per kind of Python worker (``python -m
pyspark.daemon <worker module>``), whose first worker then imports the worker module. Each imports
pyspark, pyarrow and numpy, then isbflow's connector: ~1.4 CPU-s and ~70 MiB of memory of its own
per source runner here, at every query start and restart.

The *zygote* is one process per Spark driver that has imported all of that once (:data:`PRELOAD`).
Spark's Python executable (``PYSPARK_PYTHON``, read when the SparkContext starts) becomes a small
launcher script: for the source runner and the daemons (:data:`FORKED`) it hands its argv,
environment, working directory and standard streams (over a Unix socket, the descriptors
themselves) to the zygote (:mod:`isbflow.steps.zygote_server`), which forks a child that runs the
module as ``__main__`` on those streams, with that environment and import path. The launcher stays
the process Spark watches: it forwards SIGTERM/SIGINT/SIGHUP to the child and exits with the
child's exit code. Anything else Spark runs (a version check), and everything when the zygote is
gone, execs the real Python unchanged. Forked children share the zygote's memory pages until they
write them, so their memory is mostly counted once.

Fork safety: the zygote runs no threads of its own; pyarrow's allocator and numpy's BLAS start
threads of theirs on import, and register fork handlers, as for any process that forks after
importing them (Python's ``multiprocessing`` does the same on Linux). A child is a copy of the
zygote at the fork, with the launcher's environment in place before the module's code runs.

``ISBFLOW_SPARK_ZYGOTE=0`` turns it off (Spark then starts every Python process cold).
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

#: the module Spark runs for each streaming query over a Python data source
SOURCE_RUNNER = "pyspark.sql.streaming.python_streaming_source_runner"
#: Spark's forking daemon (``python -m pyspark.daemon <worker module>``): one per kind of Python
#: worker and driver; its workers are forks of it, so they inherit what the zygote imported
DAEMON = "pyspark.daemon"
#: what the launcher hands to the zygote; everything else execs the real Python
FORKED = (SOURCE_RUNNER, DAEMON)
#: imported by the zygote before it forks: what the runners and workers of isbflow's data sources import,
#: and pandas, which Spark's Python UDF workers import after their fork (each 65-70 -> 33-37 MiB PSS)
PRELOAD = (SOURCE_RUNNER, DAEMON, "pyspark.worker", "isbflow.connector.source", "isbflow.connector.reader",
           "isbflow.connector.files", "isbflow.connector.task_publisher", "pandas", "pyspark.sql.pandas.serializers",
           "isbflow.steps.write_through_reader")  # a Delta sink vertex's read tasks write Parquet (delta-rs)
#: what a driver of a pipeline on Redis buffers preloads too (its environment names ``REDIS_URL``,
#: :func:`isbflow.steps.driver.settings_env`): without it every read task imported redis-py at its
#: first read, 0.29-0.31 s a task (py-spy: 24% of a Redis read task's wall time in bench/stores.py's A)
REDIS_PRELOAD = ("isbflow.isb.redis.connection",)
ENV_SWITCH = "ISBFLOW_SPARK_ZYGOTE"
#: seconds the zygote may take to import :data:`PRELOAD` (~1 s here; a loaded machine takes longer)
START_TIMEOUT = 120.0
#: seconds a launcher has to send its whole request once connected (it sends it as it connects; a
#: slower one is answered -1 and runs the real Python). Nothing waits on it: requests are read side
#: by side (:mod:`isbflow.steps.zygote_server`), so it only bounds what a silent client holds
RECV_TIMEOUT = 10.0

#: the launcher's Python (run with -I -S: no site-packages, nothing from the environment). It imports
#: only C modules (``_socket``, ``_signal``, ``_struct``, ``select``; no ``json``, ``socket`` or
#: ``signal``, which pull in ``re`` and ``enum``): Spark keeps one launcher per Python process it runs
#: (13 on the demo), and each held 4.3 MiB of private memory, 2.9 MiB with these imports. The request
#: is NUL-separated (no argument, environment entry or path can hold a NUL):
#: ``module, cwd, len(argv), *argv, *("NAME=value" for the environment)``; :func:`decode_request`.
#:
#: It never blocks in ``recv``: Python runs a signal's handler between bytecodes, so a signal that
#: lands after the last check and before a blocking ``recv`` enters the kernel would wait until the
#: child ended (the same race made the test's probe sleep through a SIGTERM: 2-9 in 300-500 tries).
#: A signal also writes a byte to a wakeup pipe (``set_wakeup_fd``), and ``select`` waits on that
#: pipe and the socket: the handler runs as soon as the signal lands.
LAUNCHER = r'''
import _signal, _socket, _struct, os, select, sys
REAL, SOCK, FORKED = {real!r}, {sock!r}, {forked!r}
args = sys.argv[1:]
pid, pending = 0, []
def forward(signum, frame):  # from the start: Spark may stop us before the child's pid is known
    if pid <= 0:
        pending.append(signum)
        return
    try:
        os.kill(pid, signum)
    except OSError:
        pass
def cold():
    if pending:  # stopped before the child was asked for: as the default action would
        os._exit(128 + pending[0])
    os.execv(REAL, [REAL] + args)
if len(args) < 2 or args[0] != "-m" or args[1] not in FORKED:
    cold()
wake, woken = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
_signal.set_wakeup_fd(woken)
for sig in (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP):
    _signal.signal(sig, forward)
try:
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    s.connect(SOCK)
except OSError:
    cold()
f = os.fsencode
req = b"\0".join([f(args[1]), f(os.getcwd()), b"%d" % (len(args) - 2), *map(f, args[2:]),
                  *(f(k) + b"=" + f(v) for k, v in os.environ.items())])
req = _struct.pack("!I", len(req)) + req
try:
    sent = s.sendmsg([req], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, _struct.pack("3i", 0, 1, 2))])
    if sent < len(req):
        s.sendall(req[sent:])
except OSError:  # the zygote went away, or dropped us
    cold()
def recv(n):
    b = b""
    while len(b) < n:
        if s not in select.select([s, wake], [], [])[0]:
            os.read(wake, 64)  # a signal: its handler has run
            continue
        c = s.recv(n - len(b))
        if not c:  # the zygote ended: before it forked a child, run the real Python
            cold() if pid <= 0 else sys.exit(1)
        b += c
    return b
child = _struct.unpack("!i", recv(4))[0]
if child <= 0:
    cold()
pid = child
for signum in pending:
    forward(signum, None)
sys.exit(_struct.unpack("!i", recv(4))[0])
'''


def decode_request(body: bytes) -> dict:
    """The launcher's request (:data:`LAUNCHER`) as ``{"module", "cwd", "argv", "env"}``; a
    ``ValueError`` when it is not one."""
    fields = [os.fsdecode(b) for b in body.split(b"\0")]
    if len(fields) < 3 or not fields[2].isdigit() or len(fields) < 3 + int(fields[2]):
        raise ValueError("not a launcher request")
    n = int(fields[2])
    env = {}
    for entry in fields[3 + n:]:
        name, eq, value = entry.partition("=")
        if not eq or not name:
            raise ValueError(f"an environment entry without a name: {entry[:40]!r}")
        env[name] = value
    return {"module": fields[0], "cwd": fields[1], "argv": fields[3:3 + n], "env": env}


class Zygote:
    """A running zygote: its process, its socket and the launcher Spark runs as Python."""

    def __init__(self, real_python: str, forked: tuple[str, ...] = FORKED, recv_timeout: float = RECV_TIMEOUT):
        """Start the zygote for ``real_python``; it runs only the modules ``forked`` (the launcher
        hands it nothing else) for processes of this one's uid that descend from this one."""
        self.real = real_python
        self.dir = Path(tempfile.mkdtemp(prefix="isbflow-zygote-"))  # 0700
        self.socket = str(self.dir / "zygote.sock")
        self.launcher = str(self.dir / "python")
        self.proc = subprocess.Popen([real_python, "-m", "isbflow.steps.zygote_server", self.socket,
                                      str(recv_timeout), *forked],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        assert self.proc.stdout is not None
        # the server prints "ready" once it listens (its imports done); a start that hangs is given up
        readable, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT)
        ready = self.proc.stdout.readline() if readable else b""
        if ready.strip() != b"ready":
            self.proc.kill()
            self.close()
            raise RuntimeError(f"the Spark Python zygote did not start within {START_TIMEOUT:.0f}s "
                               f"(exit {self.proc.poll()})")
        script = self.dir / "launch.py"
        script.write_text(LAUNCHER.format(real=real_python, sock=self.socket, forked=forked))
        # a shell line, not a "#!python" one: no limit on the interpreter path's length or spaces
        Path(self.launcher).write_text(
            f"#!/bin/sh\nexec {shlex.quote(real_python)} -IS {shlex.quote(str(script))} \"$@\"\n")
        os.chmod(self.launcher, 0o700)

    def close(self) -> None:
        """Stop the zygote (its stdin closes: it exits; forked runners live on until Spark stops them)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_running: Zygote | None = None


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").lower() not in ("0", "false", "no", "off")


def launcher_for(real_python: str) -> str:
    """The Python executable to give Spark: the zygote's launcher (starting the zygote on first
    use, stopped when this process exits), or ``real_python`` itself when the zygote is off or
    cannot start (Spark then starts runners cold; a warning says why)."""
    global _running
    if not enabled() or not sys.platform.startswith("linux"):
        return real_python
    if _running is None or _running.proc.poll() is not None:
        try:
            _running = Zygote(real_python)
        except (OSError, RuntimeError) as e:
            log.warning("Spark's Python source runners start cold: %s", e)
            return real_python
        atexit.register(_running.close)
    # one zygote per driver, for one Python: another interpreter is given to Spark as it is
    return _running.launcher if _running.real == real_python else real_python
