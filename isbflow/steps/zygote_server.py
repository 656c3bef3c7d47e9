"""The zygote process of :mod:`isbflow.steps.zygote`: ``python -m isbflow.steps.zygote_server SOCKET``.

Imports what a source runner imports, listens on ``SOCKET``, prints ``ready``, then for each
launcher that connects: receives the request (module, environment, working directory) and the
launcher's standard streams, forks, and in the child runs the module as ``__main__`` on those
streams. It sends the launcher the child's pid, then the child's exit code when it ends. It exits
when its standard input closes (its driver ended or closed it).
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
import traceback

import pyspark

from isbflow.steps.zygote import DAEMON, PRELOAD, SOURCE_RUNNER, decode_request

MAX_REQUEST = 1 << 20


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One length-prefixed request and the three descriptors sent with it."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 65536, 3)
    if len(fds) != 3 or len(data) < 4:
        for fd in fds:
            os.close(fd)
        raise ValueError("a launcher request needs its three standard streams")
    (n,) = struct.unpack("!I", data[:4])
    if n > MAX_REQUEST:
        raise ValueError(f"a launcher request of {n} bytes")
    body = data[4:]
    while len(body) < n:
        chunk = conn.recv(n - len(body))
        if not chunk:
            raise ValueError("the launcher went away mid-request")
        body += chunk
    try:
        return decode_request(body), fds
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise


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


def serve(path: str) -> None:
    # a Ctrl-C in the terminal reaches the whole process group: the zygote ends with its driver
    # instead (its stdin closes), and runners already forked stop as Spark tells them
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in PRELOAD:
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
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in sel.select(timeout=0.2):
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    return  # the driver closed our stdin or ended
            else:
                conn, _ = listener.accept()
                try:
                    req, fds = _recv_request(conn)
                except (OSError, ValueError) as e:
                    sys.stderr.write(f"isbflow zygote: bad request: {e}\n")
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for c in waiting.values():
                        c.close()
                    conn.close()
                    sel.close()
                    _child(req, fds)
                for fd in fds:
                    os.close(fd)
                try:
                    conn.sendall(struct.pack("!i", pid))
                except OSError:
                    pass  # the launcher is gone; the child still runs (Spark stops it through its socket)
                waiting[pid] = conn
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
    serve(sys.argv[1])
