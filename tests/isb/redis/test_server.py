"""The embedded redis-server (isbflow.isb.redis.server): loopback only, a password, owner-only
files, stopped by its PID, and a clear error when the binary is missing."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest
import redis
from redis.exceptions import AuthenticationError, ResponseError

from isbflow.isb.redis import server
from isbflow.local.procs import process_alive
from tests.helpers.redis_server import running_redis


def test_the_server_listens_on_loopback_with_a_password_and_owner_only_files():
    with running_redis() as r:
        st = r.state
        rdir = server.redis_dir(r.data_dir)
        modes = {f: stat.S_IMODE(os.stat(rdir / f).st_mode)
                 for f in (server.PASSWORD_FILE, server.CONFIG_FILE, server.STATE_FILE, server.USERS_FILE)}
        dir_mode = stat.S_IMODE(os.stat(rdir).st_mode)
        conf = (rdir / server.CONFIG_FILE).read_text()
        anonymous = redis.Redis(host=server.HOST, port=st.port)
        with pytest.raises((AuthenticationError, ResponseError), match="(?i)auth"):
            anonymous.set("k", "v")
        anonymous.close()

        async def ping() -> bool:
            admin = r.client()
            try:
                return await admin.ping()
            finally:
                await admin.aclose()

        assert asyncio.run(ping())
        listening = open("/proc/net/tcp").read()
        assert f"0100007F:{st.port:04X}" in listening  # 127.0.0.1:<port>
        assert f"00000000:{st.port:04X}" not in listening
    assert modes == dict.fromkeys(modes, 0o600) and dir_mode == 0o700
    assert "bind 127.0.0.1" in conf and "appendonly yes" in conf and "noeviction" in conf


def test_stop_ends_the_recorded_process_and_keeps_the_data():
    with running_redis() as r:
        st = r.state
        assert st.alive()
        stopped = server.stop_redis(r.data_dir)
        assert stopped is not None and stopped.pid == st.pid
        assert not process_alive(st.pid)
        assert server.read_state(r.data_dir) is None
        assert any((server.redis_dir(r.data_dir) / "appendonly").iterdir())
        again = server.start_redis(r.data_dir, persistence="aof")
        assert again.pid != st.pid and again.alive()
        assert again.port == st.port  # the last port, still free: clients keep their address


def test_starting_twice_returns_the_running_server_and_refuses_another_persistence():
    with running_redis() as r:
        st = r.state
        assert server.start_redis(r.data_dir).pid == st.pid
        with pytest.raises(server.EmbeddedRedisError, match="already runs"):
            server.start_redis(r.data_dir, persistence="none")


def test_a_missing_binary_names_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(server, "DEBIAN_PATHS", ())
    with pytest.raises(server.EmbeddedRedisError) as e:
        server.start_redis(tmp_path)
    assert "scripts/ensure-redis" in str(e.value) and "apt-get install redis-server" in str(e.value)
    assert server.read_state(tmp_path) is None


def test_an_unknown_persistence_or_fsync_is_refused(tmp_path):
    with pytest.raises(server.EmbeddedRedisError, match="aof or none"):
        server.start_redis(tmp_path, persistence="rdb")
    with pytest.raises(server.EmbeddedRedisError, match="everysec or always"):
        server.start_redis(tmp_path, fsync="no")


def test_fsync_always_is_written_into_the_config(tmp_path):
    conf = server.server_config(tmp_path, 6380, "pw", "aof", "always")
    assert "appendonly yes" in conf and "appendfsync always" in conf
    assert "appendonly no" in server.server_config(tmp_path, 6380, "pw", "none")


def test_serving_tells_the_embedded_server_by_its_address_not_a_prefix_of_it(tmp_path):
    import json
    from dataclasses import asdict

    assert server.serving(tmp_path, "redis://127.0.0.1:6379/0") is None  # nothing recorded
    rdir = server.redis_dir(tmp_path)
    rdir.mkdir(parents=True)
    state = server.RedisServerState(str(tmp_path), pid=1, port=6379, config="c", log="l", persistence="aof")
    (rdir / server.STATE_FILE).write_text(json.dumps(asdict(state)))
    assert server.serving(tmp_path, "redis://127.0.0.1:6379/0") == state
    assert server.serving(tmp_path, "redis://127.0.0.1:6379") == state
    for other in ("redis://127.0.0.1:63790/0", "redis://127.0.0.2:6379/0", "rediss://127.0.0.1:6379/0",
                  "redis://10.0.0.5:6379", "redis://127.0.0.1:notaport"):
        assert server.serving(tmp_path, other) is None, other
