"""Spark's Python processes forked from a warm zygote (:mod:`isbflow.steps.zygote`)."""

from __future__ import annotations

import inspect
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from isbflow.steps import zygote

ROOT = Path(__file__).resolve().parents[2]
PROBE = "tests.helpers.zygote_probe"
WAIT = 60


@pytest.fixture(scope="module")
def zyg():
    z = zygote.Zygote(sys.executable, forked=(PROBE,))
    yield z
    z.close()
    assert z.proc.poll() is not None, "the zygote outlived close()"
    assert not z.dir.exists(), "the zygote's socket and launcher were left behind"


def probe_env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), **extra}


def test_a_forked_child_gets_the_launchers_argv_environment_directory_streams_and_exit_code(zyg, tmp_path):
    r = subprocess.run([zyg.launcher, "-m", PROBE, "3"], input="hello\n", capture_output=True, text=True,
                       cwd=tmp_path, env=probe_env(ZYGOTE_PROBE="seen"), timeout=WAIT)
    assert r.returncode == 3, r.stderr
    seen = json.loads(r.stdout)
    assert seen["argv"] == ["3"] and seen["probe"] == "seen" and seen["stdin"] == "hello"
    assert seen["cwd"] == str(tmp_path) and seen["path0"] == str(tmp_path)
    # forked from the zygote (not started by the launcher), with what the zygote imported already there
    assert seen["ppid"] == zyg.proc.pid and seen["preloaded"] is True
    assert seen["redis"] is False  # a driver of a JetStream pipeline never imports redis-py
    # and kept out of the cyclic GC (gc.freeze): measured on the demo, 62% -> 44% of a core
    assert seen["frozen"] > 10_000, seen["frozen"]
    # named for its module (what top shows): its command line is the zygote's
    assert seen["comm"] == "zygote_probe"
    assert "to stderr" in r.stderr


def test_a_driver_on_redis_buffers_preloads_the_redis_client(monkeypatch, tmp_path):
    """A driver whose environment names REDIS_URL (a pipeline on Redis buffers) has its zygote
    import the Redis client once, so that read tasks do not each import it."""
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    z = zygote.Zygote(sys.executable, forked=(PROBE,))
    try:
        r = subprocess.run([z.launcher, "-m", PROBE, "0"], input="x\n", capture_output=True, text=True,
                           cwd=tmp_path, env=probe_env(), timeout=WAIT)
    finally:
        z.close()
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["redis"] is True


def test_a_child_leaves_out_sparks_own_copies_of_pyspark_from_its_import_path(zyg, tmp_path):
    """Spark's PYTHONPATH names pyspark.zip, py4j's zip and the spark-core jar (pyspark's sources again):
    copies of what the zygote imported, whose directories zipimport would hold in every child."""
    import pyspark

    root = Path(pyspark.__file__).parent
    spark_own = [str(p) for p in (*sorted((root / "python" / "lib").glob("*.zip")), *sorted((root / "jars").glob("spark-core_*.jar")))]
    assert len(spark_own) == 3, spark_own
    user_zip = tmp_path / "deps.zip"  # what a user ships (--py-files): kept
    user_zip.write_bytes(b"")
    env = probe_env(PYTHONPATH=os.pathsep.join([*spark_own, str(ROOT), str(user_zip)]))
    r = subprocess.run([zyg.launcher, "-m", PROBE, "0"], input="\n", capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=WAIT)
    assert r.returncode == 0, r.stderr
    path = json.loads(r.stdout)["sys_path"]
    assert path[0] == str(tmp_path) and str(user_zip) in path and str(ROOT) in path, path
    assert not set(spark_own) & set(path), path


def test_a_signal_to_the_launcher_reaches_the_child(zyg, tmp_path):
    """Spark stops a Python process by signalling the one it started: the launcher."""
    p = subprocess.Popen([zyg.launcher, "-m", PROBE, "wait"], stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                         env=probe_env())
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "waiting"
        p.send_signal(signal.SIGTERM)
        assert p.wait(WAIT) == 7
        assert json.loads(p.stdout.readline()) == {"signal": signal.SIGTERM}
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_other_commands_and_a_gone_zygote_run_the_real_python(tmp_path):
    z = zygote.Zygote(sys.executable, forked=(PROBE,))
    try:
        r = subprocess.run([z.launcher, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True,
                           timeout=WAIT)
        assert r.returncode == 0 and r.stdout.strip() == sys.executable, r.stderr
        z.proc.kill()
        z.proc.wait()
        r = subprocess.run([z.launcher, "-m", PROBE, "0"], input="x\n", capture_output=True, text=True, cwd=tmp_path,
                           env=probe_env(), timeout=WAIT)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["preloaded"] is False  # started cold: nothing imported before it
    finally:
        z.close()


def test_the_off_switch(monkeypatch):
    monkeypatch.setenv(zygote.ENV_SWITCH, "0")
    assert zygote.launcher_for(sys.executable) == sys.executable


@pytest.mark.slow
def test_spark_forks_its_source_runners_from_the_zygote(spark, tmp_path):
    """The suite's session runs through the zygote like a step's: a streaming query over a Python data
    source gets its runner from the zygote, the launcher being the process Spark started."""
    launcher = spark.sparkContext.pythonExec
    assert Path(launcher).parent.name.startswith("isbflow-zygote-"), launcher
    sock, script = str(Path(launcher).parent / "zygote.sock"), str(Path(launcher).parent / "launch.py")
    server = next(p for p in psutil.Process().children() if sock in p.cmdline())
    q = (spark.readStream.format("isb-memory").option("rows", "30").option("batchRows", "10").load()
         .writeStream.format("noop").option("checkpointLocation", str(tmp_path / "checkpoint"))
         .trigger(processingTime="1 second").start())
    try:
        q.processAllAvailable()
        launched = [p for p in psutil.process_iter(["cmdline"])
                    if script in (p.info["cmdline"] or []) and zygote.SOURCE_RUNNER in p.info["cmdline"]]
        assert launched, "no source runner started through the launcher"
        assert server.children(), "the zygote forked no process"
        # the runner is named for what it runs (top shows it), its command line being the zygote's
        assert "isbflow-source" in [c.name() for c in server.children()], [c.name() for c in server.children()]
    finally:
        q.stop()


def test_a_zygote_that_does_not_start_leaves_spark_on_the_real_python(monkeypatch, tmp_path, caplog):
    """Never a hang: a zygote that is not ready in time is killed, and Spark gets the Python it was given."""
    stuck = tmp_path / "python"
    stuck.write_text("#!/bin/sh\nexec sleep 60\n")
    stuck.chmod(0o700)
    monkeypatch.setattr(zygote, "START_TIMEOUT", 0.5)
    monkeypatch.setattr(zygote, "_running", None)
    assert zygote.launcher_for(str(stuck)) == str(stuck)
    assert "start cold" in caplog.text and "did not start within 0s" in caplog.text
    assert not [p for p in psutil.Process().children(recursive=True) if "sleep" in p.name()]


def test_the_launcher_request_round_trips_and_the_launcher_imports_only_c_modules():
    """The launcher Spark keeps beside every Python process imports no pure-Python module (``json``,
    ``socket`` and ``signal`` pull in ``re`` and ``enum``: 4.3 against 2.9 MiB of private memory
    each); its NUL-separated request carries any argument, value and path there can be."""
    import ast

    tree = ast.parse(zygote.LAUNCHER.format(real="/x/python", sock="/x/s", forked=("m",)))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)
                for a in (n.names if isinstance(n, ast.Import) else [ast.alias(n.module or "")])}
    import importlib.util

    def c_module(name: str) -> bool:  # built in, or an extension module of the standard library
        spec = importlib.util.find_spec(name)
        return name in sys.builtin_module_names or bool(spec and spec.origin and spec.origin.endswith(".so"))

    assert imported and all(c_module(m) for m in imported - {"os"}), imported
    env = {"A": "x=y=z", "EMPTY": "", "ODD": "caf\u00e9 \udcff"}  # '=' in a value; a byte no UTF-8 decodes
    argv = ["", "-x", "two words", "\udcfe"]
    f = os.fsencode
    body = b"\0".join([b"mod.ule", f("/tmp/d ir"), b"%d" % len(argv), *map(f, argv),
                       *(f(k) + b"=" + f(v) for k, v in env.items())])
    assert zygote.decode_request(body) == {"module": "mod.ule", "cwd": "/tmp/d ir", "argv": argv, "env": env}
    assert zygote.decode_request(b"m\0/\x000") == {"module": "m", "cwd": "/", "argv": [], "env": {}}
    for bad in (b"", b"m\0/", b"m\0/\0x", b"m\0/\x003\0a", b"m\0/\x000\0NOEQUALS", b"m\0/\x000\0=v"):
        with pytest.raises(ValueError):
            zygote.decode_request(bad)


# ----------------------------------------------------------------------------- what the zygote serves


def _request(module: str, argv: tuple[str, ...] = (), env: dict[str, str] | None = None) -> bytes:
    """A launcher's request (zygote.LAUNCHER), length-prefixed."""
    f = os.fsencode
    body = b"\0".join([f(module), f(os.getcwd()), b"%d" % len(argv), *map(f, argv),
                       *(f(k) + b"=" + f(v) for k, v in (env or probe_env()).items())])
    return struct.pack("!I", len(body)) + body


def _send(path: str, data: bytes, fds: list[int] | None = None) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(WAIT)
    s.connect(path)
    if fds is not None:
        socket.send_fds(s, [data], fds)
    elif data:
        s.sendall(data)
    return s


def _reply(s: socket.socket) -> int | None:
    """The zygote's first answer (a pid, -1: refused), None when it closed without one."""
    got = b""
    while len(got) < 4:
        chunk = s.recv(4 - len(got))
        if not chunk:
            return None
        got += chunk
    return struct.unpack("!i", got)[0]


def _holding(pid: int, fd: int) -> int:
    """How many of process ``pid``'s descriptors refer to the pipe ``fd`` is an end of."""
    target = f"pipe:[{os.fstat(fd).st_ino}]"
    held = 0
    for entry in os.listdir(f"/proc/{pid}/fd"):
        try:
            held += os.readlink(f"/proc/{pid}/fd/{entry}") == target
        except OSError:
            pass  # closed while listed
    return held


def _lets_go(pid: int, fd: int, within: float) -> bool:
    """Whether process ``pid`` holds no end of ``fd``'s pipe within ``within`` seconds."""
    deadline = time.monotonic() + within
    while _holding(pid, fd) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _holding(pid, fd)


@pytest.fixture(scope="module")
def quick():
    """A zygote that drops a silent client after a second."""
    z = zygote.Zygote(sys.executable, forked=(PROBE,), recv_timeout=1.0)
    yield z
    z.close()


def test_a_silent_client_does_not_stall_the_next_launcher_and_is_dropped(quick, tmp_path):
    silent = _send(quick.socket, b"")
    half = _send(quick.socket, _request(PROBE)[:10], fds=[0, 1, 2])  # a request cut short
    try:
        t0 = time.monotonic()
        r = subprocess.run([quick.launcher, "-m", PROBE, "0"], input="x\n", capture_output=True, text=True,
                           cwd=tmp_path, env=probe_env(), timeout=15)
        assert r.returncode == 0 and json.loads(r.stdout)["preloaded"] is True, r.stderr
        assert time.monotonic() - t0 < 10
        # both are answered -1 (a launcher then runs the real Python) and closed after recv_timeout
        assert _reply(silent) == -1 and silent.recv(1) == b""
        assert _reply(half) == -1 and half.recv(1) == b""
    finally:
        silent.close()
        half.close()


def test_only_the_modules_it_was_started_with_are_run(zyg):
    r, w = os.pipe()
    try:
        s = _send(zyg.socket, _request("json.tool"), fds=[r, w, w])
        assert _reply(s) == -1
        s.close()
    finally:
        os.close(r)
        os.close(w)
    # the default: the two modules Spark starts, and nothing else
    assert zygote.FORKED == ("pyspark.sql.streaming.python_streaming_source_runner", "pyspark.daemon")
    default = inspect.signature(zygote.Zygote).parameters["forked"].default
    assert default == zygote.FORKED


def test_the_descriptors_of_a_bad_request_are_closed_on_every_path(quick):
    """The zygote holds a launcher's standard streams: left open, a runner's stdout never ends."""
    body = _request(PROBE)
    bad = {
        "too large": struct.pack("!I", (1 << 20) + 1) + b"x" * 16,
        "not a request": struct.pack("!I", 3) + b"abc",
        "another module": _request("json.tool"),
        "two streams only": body,
        "gone mid-request": body[: len(body) // 2],
        "silent after its streams": body[:2],
    }
    for why, data in bad.items():
        r, w = os.pipe()
        s = _send(quick.socket, data, fds=[r, w] if why == "two streams only" else [r, w, w])
        reply = -1 if why == "gone mid-request" else _reply(s)
        s.close()
        os.close(w)
        assert _lets_go(quick.proc.pid, r, within=5), f"{why}: the zygote holds {_holding(quick.proc.pid, r)} of its fds"
        os.close(r)
        assert reply == -1, why  # answered: a launcher runs the real Python


def test_a_process_that_does_not_descend_from_the_driver_is_refused(zyg, tmp_path):
    """Another driver's processes run under the same uid: only this driver's descendants are served."""
    out = tmp_path / "reply"
    client = f"""
import os, socket, struct, sys, time
first = os.getpid()
if os.fork():
    os._exit(0)
deadline = time.monotonic() + 30
while os.getppid() == first and time.monotonic() < deadline:  # until re-parented away from this tree
    time.sleep(0.01)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
s.connect({zyg.socket!r})
socket.send_fds(s, [{_request(PROBE)!r}], [0, 1, 2])
got = b""
while len(got) < 4:
    c = s.recv(4 - len(got))
    if not c:
        break
    got += c
open({str(out)!r} + ".tmp", "w").write(str(struct.unpack("!i", got)[0]) if len(got) == 4 else "closed")
os.rename({str(out)!r} + ".tmp", {str(out)!r})
"""
    subprocess.run([sys.executable, "-c", client], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   timeout=WAIT, check=True)
    deadline = time.monotonic() + WAIT
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.read_text() == "-1"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_a_process_of_another_uid_is_refused(zyg):
    """The socket's directory keeps other users out; were it opened up, SO_PEERCRED still does."""
    os.chmod(zyg.dir, 0o711)
    os.chmod(zyg.socket, 0o666)
    r, w = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # a descendant of the driver, under another uid
            code = 1
            try:
                os.close(r)
                os.setgid(65534)
                os.setuid(65534)
                s = _send(zyg.socket, _request(PROBE), fds=[0, 1, 2])
                os.write(w, str(_reply(s)).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        w = -1
        got = b""
        while chunk := os.read(r, 64):
            got += chunk
        assert os.waitpid(pid, 0)[1] == 0
        assert got == b"-1"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        os.chmod(zyg.socket, 0o600)
        os.chmod(zyg.dir, 0o700)
