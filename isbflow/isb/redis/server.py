"""An embedded redis-server for the Redis buffer store, kept under ``<data dir>/redis/``.

:func:`start_redis` starts Debian's ``redis-server`` (``scripts/ensure-redis`` installs it) on
127.0.0.1 only, on a free port or the one given, with a config written there (owner-only):

- ``requirepass`` with a generated password kept in ``<data dir>/redis/password`` (owner-only,
  kept across restarts): the admin. The role users of :mod:`isbflow.isb.redis.acl` come from
  ``users.conf`` beside it (included by the config), so they survive a restart too;
- ``appendonly yes`` by default, so a restart keeps the buffers: ``fsync="everysec"`` (Redis's
  default: a crash of the machine may lose the last second of writes) or ``"always"`` (every
  write on disk before it is answered; slower); with ``persistence="none"`` nothing is written to
  disk and a restart starts empty (every buffer is then reported lost,
  :mod:`isbflow.isb.redis.loss`);
- ``maxmemory-policy noeviction``: a full server refuses writes instead of evicting buffers.

The PID (and the process's start time) are recorded in ``state.json``; :func:`stop_redis` signals
only that process, and only while ``/proc/<pid>/cmdline`` still shows it is ours: SIGTERM (sent
again every half second), then SIGKILL after ``timeout``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import redis
from redis.exceptions import BusyLoadingError, ConnectionError, ResponseError

from isbflow.local.files import tail
from isbflow.local.procs import process_alive, process_start
from isbflow.spec.paths import private_dir, private_secret, write_private

HOST = "127.0.0.1"
STATE_FILE = "state.json"
CONFIG_FILE = "redis.conf"
#: the role users' ``user`` directives (:mod:`isbflow.isb.redis.acl`), included by the config
USERS_FILE = "users.conf"
PASSWORD_FILE = "password"
#: the port of the last start, used again when free (clients keep their address across a restart)
PORT_FILE = "port"
PERSISTENCE = ("aof", "none")
FSYNC = ("everysec", "always")
#: where Debian's package puts the binary (looked at when PATH has none)
DEBIAN_PATHS = ("/usr/bin/redis-server", "/usr/sbin/redis-server")
#: seconds between SIGTERMs while stopping (:func:`stop_redis`)
TERM_AGAIN = 0.5
INSTALL_HINT = "install it with scripts/ensure-redis (or: apt-get install redis-server)"


class EmbeddedRedisError(Exception):
    """The embedded redis-server could not be started, found or stopped (message says why)."""


@dataclass
class RedisServerState:
    data_dir: str
    pid: int
    port: int
    config: str
    log: str
    persistence: str
    proc_start: int | None = None
    started_at: float = field(default_factory=time.time)

    @property
    def password(self) -> str:
        """The admin's password (``requirepass``)."""
        return (redis_dir(self.data_dir) / PASSWORD_FILE).read_text().strip()

    def alive(self) -> bool:
        """The recorded PID still runs *our* redis-server: the process started when recorded, and its
        title shows our port (redis-server replaces its command line with ``<binary> <host>:<port>`` once
        up) or, before that, our config."""
        if not process_alive(self.pid, self.proc_start):
            return False
        try:
            title = Path(f"/proc/{self.pid}/cmdline").read_bytes()
        except FileNotFoundError:
            return False
        except OSError:  # no /proc: trust the PID
            return True
        return f"{HOST}:{self.port}".encode() in title or self.config.encode() in title.split(b"\0")


def redis_dir(data_dir: Path | str) -> Path:
    return Path(data_dir).absolute() / "redis"


def redis_server_binary() -> str:
    """``redis-server`` from PATH (or Debian's /usr/bin, /usr/sbin); a clear error when there is none."""
    found = shutil.which("redis-server") or next((p for p in DEBIAN_PATHS if os.access(p, os.X_OK)), None)
    if found is None:
        raise EmbeddedRedisError(f"redis-server not found on PATH: {INSTALL_HINT}")
    return found


secret = private_secret  # owner-only, made on first use: as the NATS roles' passwords


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def serving(data_dir: Path | str, url: str) -> RedisServerState | None:
    """The redis-server recorded under ``data_dir`` when ``url`` is its address (the embedded
    server, whose users and grants isbflow keeps there), else None (an external server)."""
    state = read_state(data_dir)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    return state if state is not None and (parts.scheme, parts.hostname, port) == ("redis", HOST, state.port) else None


def read_state(data_dir: Path | str) -> RedisServerState | None:
    """The recorded embedded redis-server, or None when none was started under ``data_dir``."""
    path = redis_dir(data_dir) / STATE_FILE
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
        return RedisServerState(**{k: v for k, v in d.items() if k in RedisServerState.__dataclass_fields__})
    except (ValueError, TypeError) as e:
        raise EmbeddedRedisError(f"{path} is not a state file isbflow wrote ({e}): stop any redis-server it "
                                 "names and remove it") from None


def server_config(rdir: Path, port: int, password: str, persistence: str, fsync: str = "everysec") -> str:
    """The redis-server config for ``rdir`` (module doc)."""
    durable = ["appendonly yes", f"appendfsync {fsync}", 'appenddirname "appendonly"']
    lines = [
        f"bind {HOST}", "protected-mode yes", f"port {port}", f'dir "{rdir}"', 'logfile "redis.log"',
        "daemonize no", f"requirepass {password}", "maxmemory-policy noeviction", 'save ""',
        *(durable if persistence == "aof" else ["appendonly no"]),
        f'include "{rdir / USERS_FILE}"',
    ]
    return "\n".join(lines) + "\n"


def start_redis(data_dir: Path | str, port: int | None = None, persistence: str = "aof",
                timeout: float = 30.0, fsync: str = "everysec") -> RedisServerState:
    """Start redis-server for ``data_dir`` (module doc), or return the one already running there;
    on the port given, else on the last start's when free, else on a free one.
    Raises :class:`EmbeddedRedisError` saying what failed and where the log is."""
    if persistence not in PERSISTENCE:
        raise EmbeddedRedisError(f"persistence {persistence!r}: use {' or '.join(PERSISTENCE)}")
    if fsync not in FSYNC:
        raise EmbeddedRedisError(f"fsync {fsync!r}: use {' or '.join(FSYNC)}")
    existing = read_state(data_dir)
    if existing is not None and existing.alive():
        if existing.persistence != persistence or (port is not None and existing.port != port):
            raise EmbeddedRedisError(f"a redis-server (port {existing.port}, persistence {existing.persistence}) "
                                     f"already runs under {redis_dir(data_dir)}: stop it first")
        return existing
    binary = redis_server_binary()
    rdir = private_dir(redis_dir(data_dir))
    os.chmod(rdir, 0o700)
    password = secret(rdir / PASSWORD_FILE)
    users = rdir / USERS_FILE
    if not users.exists():
        write_private(users, "")
    port = port or _last_port(rdir) or free_port()
    write_private(rdir / PORT_FILE, str(port))
    conf = rdir / CONFIG_FILE
    write_private(conf, server_config(rdir, port, password, persistence, fsync))
    out = rdir / "redis.out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "ab") as logf:
        proc = subprocess.Popen([binary, str(conf)], stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, umask=0o077)
    state = RedisServerState(str(Path(data_dir).absolute()), proc.pid, port, str(conf), str(rdir / "redis.log"),
                             persistence, process_start(proc.pid))
    # recorded before waiting: if this process dies now, stop_redis still finds the server
    write_private(rdir / STATE_FILE, json.dumps(asdict(state), indent=2))
    client = redis.Redis(host=HOST, port=port, password=password, socket_timeout=2)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                (rdir / STATE_FILE).unlink(missing_ok=True)
                last = "\n".join(t for t in (tail(out, 10, 4096), tail(state.log, 10, 4096)) if t)
                raise EmbeddedRedisError(f"redis-server exited with {proc.returncode}; log {state.log}:\n{last}")
            try:
                if client.ping():
                    return state
            except (ConnectionError, BusyLoadingError, ResponseError):
                pass
            if time.monotonic() > deadline:
                _stop(state, 5.0)
                (rdir / STATE_FILE).unlink(missing_ok=True)
                raise EmbeddedRedisError(f"redis-server did not answer within {timeout:.0f}s (log {state.log})")
            time.sleep(0.05)
    finally:
        client.close()


def _last_port(rdir: Path) -> int | None:
    try:
        port = int((rdir / PORT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return port if _port_free(port) else None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _stop(state: RedisServerState, timeout: float) -> None:
    """SIGTERM our server (it writes its AOF and exits), again every :data:`TERM_AGAIN` seconds, and
    SIGKILL when it is still there after ``timeout``. Sent again because a redis-server can miss it:
    one just promoted from replica (``REPLICAOF NO ONE`` right after its first sync) ignored the
    first SIGTERM and took the second."""
    deadline = time.monotonic() + timeout
    term_at = 0.0
    while time.monotonic() < deadline:
        try:  # reap it when it is our child
            os.waitpid(state.pid, os.WNOHANG)
        except ChildProcessError:
            pass
        if not state.alive():
            return
        if time.monotonic() >= term_at:
            try:
                os.kill(state.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            term_at = time.monotonic() + TERM_AGAIN
        time.sleep(0.05)
    try:
        os.kill(state.pid, signal.SIGKILL)
        os.waitpid(state.pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def stop_redis(data_dir: Path | str, timeout: float = 10.0) -> RedisServerState | None:
    """Stop the redis-server recorded under ``data_dir`` (by PID) and forget it. Keeps its data."""
    state = read_state(data_dir)
    if state is None:
        return None
    _stop(state, timeout)
    (redis_dir(data_dir) / STATE_FILE).unlink(missing_ok=True)
    return state
