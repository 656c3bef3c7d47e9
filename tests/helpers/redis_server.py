"""A throwaway redis-server for the Redis store's tests, stopped by PID.

:func:`running_redis` starts Debian's ``redis-server`` through the store's own
:func:`isbflow.isb.redis.server.start_redis` in a temporary data dir (127.0.0.1, a free port,
a generated password) and stops it by its recorded PID on exit, whatever the test did to it
(a test may stop and start it again on the same data). A machine without ``redis-server``
fails the test naming ``scripts/ensure-redis`` (run by ``make test``), never skips it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis.asyncio

from isbflow.isb.redis import server
from isbflow.isb.redis.acl import ADMIN
from isbflow.isb.redis.client import connect
from isbflow.isb.settings import RedisSettings


@dataclass
class RedisHandle:
    """The data dir of a running test server, and how to reach and restart it."""

    data_dir: Path
    persistence: str

    @property
    def state(self) -> server.RedisServerState:
        st = server.read_state(self.data_dir)
        assert st is not None, f"no redis-server recorded under {self.data_dir}"
        return st

    def settings(self, user: str = ADMIN) -> RedisSettings:
        """The settings an isbflow connection takes (:func:`isbflow.isb.connect.connect`), as ``user``."""
        from isbflow.isb.redis.acl import password_file

        return RedisSettings(url=f"redis://127.0.0.1:{self.state.port}/0", user=None if user == ADMIN else user,
                             password=password_file(self.data_dir, user).read_text().strip())

    def client(self, user: str = ADMIN) -> redis.asyncio.Redis:
        return connect(self.data_dir, user)

    def restart(self, persistence: str | None = None) -> server.RedisServerState:
        """Stop the server (SIGTERM: it writes its append-only file first) and start it again on
        the same data dir (and, when still free, port)."""
        server.stop_redis(self.data_dir)
        self.persistence = persistence or self.persistence
        return server.start_redis(self.data_dir, persistence=self.persistence)


@contextmanager
def running_redis(persistence: str = "aof") -> Iterator[RedisHandle]:
    try:
        server.redis_server_binary()
    except server.EmbeddedRedisError as e:
        pytest.fail(f"{e} (make test runs scripts/ensure-redis)")
    folder = Path(tempfile.mkdtemp(prefix="isbflow-redis-"))
    try:
        server.start_redis(folder, persistence=persistence)
        yield RedisHandle(folder, persistence)
    finally:
        server.stop_redis(folder)
        shutil.rmtree(folder, ignore_errors=True)
