"""The embedded ISB service through its CLI: ``isbflow nats up|status|down``.

Every test runs the real command in a subprocess with its own ``--data-dir``;
the fixture runs ``nats down`` at teardown and then kills, by PID, any node the
state file named that is still alive.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import nats.js.errors
import pytest
from nats.js.api import StreamConfig

from isbflow.isb import readiness
from isbflow.isb.connect import IsbUnreachable, NatsSettings, connect, settings_from_url
from isbflow.isb.server import HOST, free_port, nats_server_binary, read_state
from tests.conftest import ROOT

ISBFLOW = str(ROOT / ".venv" / "bin" / "isbflow")


def nats_cli(*args: str, data_dir: Path, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([ISBFLOW, "nats", *args, "--data-dir", str(data_dir)],
                       capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    if check:
        assert r.returncode == 0, r.stderr
    return r


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.fixture
def data_dir(tmp_path):
    """A data dir for the CLI; whatever it still runs is stopped at teardown, by PID."""
    d = tmp_path / "home"
    try:
        yield d
    finally:
        state = read_state(d)
        subprocess.run([ISBFLOW, "nats", "down", "--data-dir", str(d)], capture_output=True, timeout=60)
        for n in state.nodes if state else []:
            if _pid_alive(n.pid):
                os.kill(n.pid, signal.SIGKILL)


def _up(data_dir: Path, *args: str) -> dict:
    r = nats_cli("up", "--json", *args, data_dir=data_dir)
    return json.loads(r.stdout)


def _listening(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by ``pids`` (from /proc)."""
    inodes: set[str] = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:  # 0A = LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            if width == 8:
                addr = ".".join(str(int(addr_hex[i:i + 2], 16)) for i in (6, 4, 2, 0))
            else:
                addr = "ipv6:" + addr_hex
            out.append((addr, int(port_hex, 16)))
    return out


def _settings(shown: dict) -> NatsSettings:
    """What a client needs, from the printed state: its URLs (no credentials) and the password's file."""
    password = Path(shown["password_file"]).read_text().strip()
    return NatsSettings(servers=tuple(shown["urls"]), user=shown["user"], password=password)


async def _publish_and_count(settings: NatsSettings, stream: str, replicas: int = 1) -> int:
    nc = await connect(settings)
    try:
        # creating an R3 stream waits for its raft group: past the client's default 5 s on a loaded
        # machine (seen in CI); provisioning allows 30 s too (isbflow.isb.provision)
        js = nc.jetstream(timeout=30.0)
        await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"], num_replicas=replicas))
        for i in range(3):
            for attempt in range(50):  # a new R3 stream answers 503 until its leader is elected
                try:
                    ack = await js.publish(f"{stream}.x", f"m{i}".encode(), headers={"Nats-Msg-Id": f"m{i}"})
                    break
                except nats.js.errors.NoStreamResponseError:
                    if attempt == 49:
                        raise
                    await asyncio.sleep(0.2)
            assert ack.stream == stream
        return (await js.stream_info(stream)).state.messages
    finally:
        await nc.close()


def test_single_node_lifecycle(data_dir):
    up = _up(data_dir)
    password = (data_dir / "nats" / "password").read_text().strip()
    assert len(up["nodes"]) == 1 and up["urls"] == [f"nats://{HOST}:{up['nodes'][0]['client_port']}"]
    assert up["user"] == "isbflow" and up["password_file"] == str((data_dir / "nats" / "password").absolute())

    r = nats_cli("status", "--json", data_dir=data_dir)
    status = json.loads(r.stdout)
    assert status["running"] is True and status["alive"] == [True]
    assert status["urls"] == up["urls"] and password not in r.stdout

    # no command prints the password: the text output names the file instead
    for cmd in ("status", "up"):
        out = nats_cli(cmd, data_dir=data_dir)
        assert password not in out.stdout + out.stderr
        assert f"NATS_URL=nats://{HOST}:{up['nodes'][0]['client_port']}" in out.stdout
        assert f"password in {up['password_file']}" in out.stdout

    # the printed URL and the password file work with any client
    assert asyncio.run(_publish_and_count(_settings(status), "lifecycle")) == 3

    # anonymous clients are refused, with a message that says why
    anonymous = f"nats://{HOST}:{status['nodes'][0]['client_port']}"
    with pytest.raises(IsbUnreachable, match="authorization"):
        asyncio.run(connect(settings_from_url(anonymous)))

    # secrets are owner-only; the state file holds no password
    for name in ("password", "n1.conf", "state.json"):
        mode = stat.S_IMODE((data_dir / "nats" / name).stat().st_mode)
        assert mode == 0o600, (name, oct(mode))
    assert stat.S_IMODE((data_dir / "nats").stat().st_mode) == 0o700
    assert password not in (data_dir / "nats" / "state.json").read_text()

    # running 'up' again reuses the live server
    again = _up(data_dir)
    assert [n["pid"] for n in again["nodes"]] == [n["pid"] for n in up["nodes"]]

    pids = {n["pid"] for n in up["nodes"]}
    r = nats_cli("down", "--json", data_dir=data_dir)
    assert set(json.loads(r.stdout)["stopped"]) == pids
    assert not any(_pid_alive(p) for p in pids)
    r = nats_cli("status", data_dir=data_dir, check=False)
    assert r.returncode == 1

    # a restart keeps the data and the URLs (same ports when free, same password)
    up2 = _up(data_dir)
    assert up2["urls"] == up["urls"]
    assert asyncio.run(_stream_messages(_settings(up2), "lifecycle")) == 3


async def _stream_messages(settings: NatsSettings, stream: str) -> int:
    nc = await connect(settings)
    try:
        return (await nc.jetstream().stream_info(stream)).state.messages
    finally:
        await nc.close()


def test_cluster_of_three(data_dir, tmp_path):
    up = _up(data_dir, "--cluster", "3")
    assert len(up["nodes"]) == 3 and len(up["urls"]) == 3
    settings = _settings(up)

    async def r3() -> tuple[int, list]:
        count = await _publish_and_count(settings, "r3", replicas=3)
        nc = await connect(settings)
        try:
            js = nc.jetstream(timeout=30.0)
            deadline = time.monotonic() + 30
            while True:
                info = await js.stream_info("r3")
                peers = info.cluster.replicas or []
                if sum(1 for p in peers if p.current) == 2 or time.monotonic() > deadline:
                    return count, peers
                await asyncio.sleep(0.2)
        finally:
            await nc.close()

    count, peers = asyncio.run(r3())
    assert count == 3
    assert len(peers) == 2 and all(p.current for p in peers), peers

    # up waited until a stream with a replica on each node could be placed, and left no probe behind
    state = read_state(data_dir)
    assert readiness.placement_ready(state)
    assert not readiness.placement_ready(dataclasses.replace(state, nodes=[*state.nodes, state.nodes[0]]))

    async def names() -> list[str]:
        nc = await connect(settings)
        try:
            return [i.config.name for i in await nc.jetstream().streams_info()]
        finally:
            await nc.close()

    assert readiness.PROBE_STREAM not in asyncio.run(names())

    # routes need their own credentials, not the client's
    conf = (data_dir / "nats" / "n1.conf").read_text()
    route_pw = (data_dir / "nats" / "route-password").read_text().strip()
    client_pw = (data_dir / "nats" / "password").read_text().strip()
    assert route_pw != client_pw
    cluster_block = conf[conf.index("cluster {"):]
    assert f'authorization {{ user: "route", password: "{route_pw}"' in cluster_block
    assert f"nats-route://route:{route_pw}@{HOST}:" in cluster_block
    assert stat.S_IMODE((data_dir / "nats" / "route-password").stat().st_mode) == 0o600


    # everything listens on loopback only: client, monitoring and route ports
    pids = {n["pid"] for n in up["nodes"]}
    listening = _listening(pids)
    expected = {p for n in up["nodes"] for p in (n["client_port"], n["http_port"], n["cluster_port"])}
    assert {port for _, port in listening} == expected
    assert {addr for addr, _ in listening} == {"127.0.0.1"}

    # a server that tries to join without the route credentials is turned away
    _rogue_route_is_refused(up["nodes"][0], tmp_path)


def _rogue_route_is_refused(n1: dict, tmp_path: Path) -> None:
    conf = tmp_path / "rogue.conf"
    conf.write_text(
        f"server_name: rogue\nlisten: {HOST}:{free_port()}\n"
        f"cluster {{ name: isbflow, listen: {HOST}:{free_port()}, "
        f'routes: ["nats-route://{HOST}:{n1["cluster_port"]}"] }}\n'
    )
    log = tmp_path / "rogue.log"
    with open(log, "wb") as out:
        rogue = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=out, stderr=subprocess.STDOUT)
    try:
        n1_log = Path(n1["log"])
        deadline = time.monotonic() + 20
        refused = "Router connection closed: Authentication Failure"
        while refused not in n1_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert refused in n1_log.read_text(), n1_log.read_text()[-2000:]
        import urllib.request

        with urllib.request.urlopen(f"http://{HOST}:{n1['http_port']}/routez", timeout=5) as r:
            routes = json.loads(r.read())["routes"]
        assert {rt.get("remote_name") for rt in routes} <= {"n2", "n3"}
    finally:
        rogue.terminate()
        rogue.wait(timeout=10)


def test_status_when_nothing_runs(tmp_path):
    r = nats_cli("status", data_dir=tmp_path, check=False)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no embedded nats-server" in lines[0] and "isbflow nats up" in lines[0]
    r = nats_cli("down", data_dir=tmp_path)
    assert "nothing to stop" in r.stdout


def test_cluster_of_two_is_refused(tmp_path):
    r = nats_cli("up", "--cluster", "2", data_dir=tmp_path, check=False)
    assert r.returncode == 2
    assert "--cluster 2" in r.stderr and "majority" in r.stderr
    assert not (tmp_path / "nats" / "state.json").exists()


def test_the_server_log_rotates_and_keeps_a_bounded_number_of_files(tmp_path, monkeypatch):
    """A small rotation size (the default is 10MB): after several starts on the same data dir the
    node's log has rotated, at most LOGS_KEPT files remain, and all are owner-only."""
    from isbflow.isb import server, server_config

    monkeypatch.setattr(server_config, "LOG_SIZE_LIMIT", "1KB")
    monkeypatch.setattr(server_config, "LOGS_KEPT", 2)
    data_dir = tmp_path / "d"
    try:
        for _ in range(4):  # each start logs ~1KB of banner
            server.start_embedded(data_dir)
            server.stop_embedded(data_dir)
    finally:
        server.stop_embedded(data_dir)
    nats = data_dir / "nats"
    logs = sorted(p.name for p in nats.iterdir() if p.name.startswith("n1.log"))
    assert "logfile_size_limit: 1KB" in (nats / "n1.conf").read_text()
    assert "n1.log" in logs and len(logs) == 2, logs  # rotated, and only 2 kept
    for name in [*logs, "n1.out"]:
        assert stat.S_IMODE((nats / name).stat().st_mode) == 0o600, name
    assert "Server is ready" in server.tail(nats / "n1.log", 200) + "".join(
        (nats / n).read_text() for n in logs)


def test_a_port_taken_between_choosing_and_binding_it_is_replaced(tmp_path, monkeypatch):
    """free_port() can hand out a port another process takes before nats-server binds it (CI saw
    'listen tcp ...: bind: address already in use' on a cluster port): the start tries fresh ports."""
    import socket

    from isbflow.isb import server

    squatter = socket.socket()
    squatter.bind((HOST, 0))
    squatter.listen(1)
    taken = squatter.getsockname()[1]
    real = server.free_port
    handed = iter([taken])
    monkeypatch.setattr(server, "free_port", lambda: next(handed, None) or real())
    try:
        state = server.start_embedded(tmp_path, cluster=1)
        try:
            assert taken not in (state.nodes[0].client_port, state.nodes[0].http_port)
            assert asyncio.run(_publish_and_count(settings_from_url(state.url), "PORTS")) == 3
        finally:
            server.stop_embedded(tmp_path)
    finally:
        squatter.close()
