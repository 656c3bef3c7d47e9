"""The zygote process of :mod:`isbflow.steps.zygote`: ``python -m isbflow.steps.zygote_server SOCKET
[TIMEOUT [MODULE ...]]``.

Imports what a source runner imports, listens on ``SOCKET``, prints ``ready``, then for each
launcher that connects: receives the request (module, environment, working directory) and the
launcher's standard streams, forks, and in the child runs the module as ``__main__`` on those
streams. It sends the launcher the child's pid, then the child's exit code when it ends. It exits
when its standard input closes (its driver ended or closed it).

Contract towards its clients (anything that can reach the socket, which its 0700 directory and
0600 mode already keep to the driver's user):

- *who*: only a process of the zygote's own uid (``SO_PEERCRED``) that descends from the process
  that started the zygote, its driver. Spark's launchers do (the driver starts the JVM, the JVM
  the launchers); another driver's processes under the same uid do not. The uid alone would let
  any of them have this driver's zygote fork a child, a copy of a process started with this
  driver's environment (its credentials) and whatever confinement the driver's processes run
  under. The peer is pinned by its pidfd (``SO_PEERPIDFD``, Linux 6.5+) while its ancestry is read,
  so a client that connects and exits cannot pass on a recycled pid (without it the residual race
  is a pid reused within the check);
- *what*: only the modules it was started with (``MODULE``; by default :data:`FORKED`, the two
  Spark starts: its streaming source runner and its forking daemon);
- *when*: a request arrives without blocking anyone: each connection is read as its bytes come,
  beside the others, and one that has not sent its whole request within ``TIMEOUT`` seconds
  (:data:`RECV_TIMEOUT`) is dropped; at most :data:`MAX_PENDING` requests are in flight (past it
  the oldest is dropped);
- a refused or failed request is answered with pid ``-1`` (the launcher then runs the real Python
  itself, as it does without a zygote), and the descriptors it carried are closed on every path.
"""

from __future__ import annotations

import gc
import importlib
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import time
import traceback

import pyspark

from isbflow.steps.zygote import (
    DAEMON,
    FORKED,
    PRELOAD,
    RECV_TIMEOUT,
    REDIS_PRELOAD,
    SOURCE_RUNNER,
    decode_request,
)

MAX_REQUEST = 1 << 20
#: requests being received at once, at most (a launcher sends its whole request as it connects)
MAX_PENDING = 32
#: ``SO_PEERPIDFD`` (Linux 6.5+; Python 3.11's socket module does not name it)
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Refused(ValueError):
    """A request the zygote does not serve; the message says why."""


class _Pending:
    """A launcher's connection whose request is still arriving, and the descriptors it sent."""

    def __init__(self, conn: socket.socket, deadline: float):
        self.conn, self.deadline = conn, deadline
        self.refused: str | None = None  # why its client is not served (answered once its request is in)
        self.data = b""
        self.fds: list[int] | None = None  # None: nothing received yet

    def receive(self) -> dict | None:
        """Read what has arrived: the request once whole (None before). ValueError when it is not one
        (:meth:`close` then closes what it carried)."""
        if self.fds is None:
            data, fds, _flags, _addr = socket.recv_fds(self.conn, 65536, 3)
            self.fds = list(fds)
            if len(self.fds) != 3:
                raise ValueError("a launcher request needs its three standard streams")
        else:
            data = self.conn.recv(65536)
        if not data:
            raise ValueError("the launcher went away mid-request")
        self.data += data
        if len(self.data) < 4:
            return None
        (n,) = struct.unpack("!I", self.data[:4])
        if n > MAX_REQUEST:
            raise ValueError(f"a launcher request of {n} bytes (at most {MAX_REQUEST})")
        if len(self.data) < 4 + n:
            return None
        if len(self.data) > 4 + n:
            raise ValueError("bytes after the launcher request")
        return decode_request(self.data[4:])

    def close(self, reply: bool = False) -> None:
        """Close the descriptors received and the connection (``reply``: first answer pid -1, so a
        launcher runs the real Python itself)."""
        for fd in self.fds or ():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
        if reply:
            _send_pid(self.conn, -1)
        self.conn.close()


def _send_pid(conn: socket.socket, value: int) -> None:
    try:
        conn.setblocking(True)
        conn.settimeout(1.0)  # four bytes into an empty socket buffer: never waits in practice
        conn.sendall(struct.pack("!i", value))
    except OSError:
        pass  # the launcher is gone


def _parent_of(pid: int) -> int:
    """``pid``'s parent (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    return int(stat[stat.rindex(b")") + 2:].split()[1])  # after "(comm)": state, then ppid


def _pidfd_of(conn: socket.socket) -> int | None:
    try:
        return conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        return None  # a kernel before 6.5


def check_peer(conn: socket.socket, driver: int) -> None:
    """:class:`Refused` unless the process at the other end of ``conn`` runs under this uid and
    descends from ``driver`` (module docstring)."""
    pid, uid, _gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    if uid != os.getuid():
        raise Refused(f"a client of uid {uid} (pid {pid}); only uid {os.getuid()} is served")
    if os.getppid() != driver:
        raise Refused(f"the driver (pid {driver}) that started the zygote is gone")
    pidfd = _pidfd_of(conn)
    try:
        at, steps = pid, 0
        while at not in (driver, 0, 1) and steps < 64:
            at, steps = _parent_of(at), steps + 1
        if at != driver:
            raise Refused(f"process {pid} does not descend from the driver (pid {driver}) that started the zygote")
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, 0)
            except ProcessLookupError:
                raise Refused(f"process {pid} ended before its request was read") from None
    finally:
        if pidfd is not None:
            os.close(pidfd)


_PYSPARK = os.path.realpath(os.path.dirname(pyspark.__file__))
#: The directories of the installed pyspark whose archives Spark puts on its Python processes'
#: PYTHONPATH (its ``sparkPythonPath``: ``python/lib/pyspark.zip``, py4j's zip, the spark-core jar,
#: which holds pyspark's sources again): copies of the pyspark and py4j this zygote imported.
SPARK_ARCHIVES = (os.path.join(_PYSPARK, "python", "lib") + os.sep, os.path.join(_PYSPARK, "jars") + os.sep)


def _import_path(pythonpath: str) -> list[str]:
    """The launcher's PYTHONPATH entries a child puts on ``sys.path``: all but Spark's own archives
    of the installed pyspark (:data:`SPARK_ARCHIVES`). The first import a child makes that is not in
    ``sys.modules`` walks them, and zipimport keeps each archive's whole directory, read again by
    every ``importlib.invalidate_caches()`` (Spark's worker setup calls it): 3.8 MiB for the jar's
    5,973 entries, 0.9 MiB for pyspark.zip. Measured on the demo (100 events/s): every source runner
    held 6-7 MiB of these names privately (24 MiB of PSS, against 9-10 MiB for a runner without)."""
    out = []
    for entry in pythonpath.split(os.pathsep):
        if not entry or entry in sys.path or entry in out:
            continue
        if entry.endswith((".zip", ".jar")) and os.path.realpath(entry).startswith(SPARK_ARCHIVES):
            continue
        out.append(entry)
    return out


#: the name (``comm``: what ``top`` and ``ps -o comm`` show) a forked child takes for the module it
#: runs; its command line stays the zygote's. A daemon's workers are its forks: they keep its name.
NAMES = {SOURCE_RUNNER: "isbflow-source", DAEMON: "isbflow-daemon"}


def _name(module: str) -> None:
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(NAMES.get(module, module.rpartition(".")[2])[:15])
    except OSError:
        pass  # a name is for the eye only


def _child(req: dict, fds: list[int]) -> None:
    """In the forked child: become the runner Spark asked for, on the launcher's streams."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a Python started cold
        _name(req["module"])
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        # the import path a cold ``python -m`` would have: its working directory first, then the
        # launcher's PYTHONPATH (Spark adds its own entries there) less Spark's copies of the
        # pyspark already imported here (_import_path), then the zygote's own
        sys.path[0] = req["cwd"]
        sys.path[1:1] = _import_path(req["env"].get("PYTHONPATH", ""))
        sys.argv = [req["module"], *req.get("argv", [])]
        # run as __main__ from a fresh module (its imports stay cached); a preloaded copy left in
        # sys.modules would make runpy warn on the runner's stderr
        sys.modules.pop(req["module"], None)
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the runner's own failure, reported like Python would
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _fork(req: dict, fds: list[int], closing: list) -> int:
    """Fork the child that runs ``req`` on ``fds``; in the child, ``closing`` (sockets and
    :class:`_Pending` requests of other launchers) is closed first. The parent gets the pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for c in closing:
            c.close()
        _child(req, fds)
    return pid


def serve(path: str, allowed: tuple[str, ...] = FORKED, recv_timeout: float = RECV_TIMEOUT) -> None:
    """Serve launchers on ``path`` until standard input closes (module docstring: the contract)."""
    # a Ctrl-C in the terminal reaches the whole process group: the zygote ends with its driver
    # instead (its stdin closes), and runners already forked stop as Spark tells them
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    driver = os.getppid()
    for name in PRELOAD + (REDIS_PRELOAD if os.environ.get("REDIS_URL") else ()):
        importlib.import_module(name)
    # what was imported stays out of the cyclic GC's reach: a child's collections then do not write
    # the shared objects' GC headers, which would copy their pages into every child
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    waiting: dict[int, socket.socket] = {}  # child pid -> its launcher's connection
    pending: dict[socket.socket, _Pending] = {}  # requests still arriving, oldest first

    def drop(p: _Pending, why: str, reply: bool = True) -> None:
        sys.stderr.write(f"isbflow zygote: request refused: {p.refused or why}\n")
        pending.pop(p.conn, None)
        sel.unregister(p.conn)
        p.close(reply=reply)

    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        now = time.monotonic()
        for p in [p for p in pending.values() if p.deadline <= now]:
            drop(p, f"no whole request within {recv_timeout:g}s")
        wait = min([0.2, *(p.deadline - now for p in pending.values())])
        for key, _ in sel.select(timeout=max(wait, 0.0)):
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    return  # the driver closed our stdin or ended
            elif key.data == "accept":
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                p = _Pending(conn, time.monotonic() + recv_timeout)
                try:
                    check_peer(conn, driver)
                except (Refused, OSError) as e:
                    # answered once its request is in: closed before, a launcher's send would fail
                    # (EPIPE) instead of reading -1 and running the real Python
                    p.refused = str(e)
                if len(pending) >= MAX_PENDING:
                    drop(next(iter(pending.values())), f"over {MAX_PENDING} requests in flight, the oldest dropped")
                conn.setblocking(False)
                pending[conn] = p
                sel.register(conn, selectors.EVENT_READ, p)
            else:
                p = key.data
                if pending.get(p.conn) is not p:
                    continue  # dropped since select returned (the oldest, past MAX_PENDING)
                try:
                    req = p.receive()
                    if req is None:
                        continue
                    if p.refused is not None:
                        raise Refused(p.refused)
                    if req["module"] not in allowed:
                        raise Refused(f"module {req['module']!r} is not one it runs ({', '.join(allowed)})")
                except BlockingIOError:
                    continue
                except (OSError, ValueError) as e:
                    drop(p, str(e))
                    continue
                pending.pop(p.conn)
                sel.unregister(p.conn)
                fds, p.fds = p.fds or [], []
                try:
                    pid = _fork(req, fds, [listener, sel, *waiting.values(), *pending.values(), p.conn])
                except OSError as e:
                    sys.stderr.write(f"isbflow zygote: cannot fork for {req['module']}: {e}\n")
                    pid = -1
                finally:
                    for fd in fds:
                        os.close(fd)
                _send_pid(p.conn, pid)
                if pid > 0:
                    waiting[pid] = p.conn
                else:
                    p.conn.close()
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], tuple(sys.argv[3:]) or FORKED, float(sys.argv[2]) if len(sys.argv) > 2 else RECV_TIMEOUT)
