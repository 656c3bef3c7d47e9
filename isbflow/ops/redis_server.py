"""The embedded redis-server of a ``redis.native`` ISB service, for the faces (the local platform):
what runs under a data dir, described without secrets, and stopping it by its recorded PID.

It is started by :func:`isbflow.ops.isb_service.up` (:mod:`isbflow.isb.redis.server`). Importing
this module loads redis-py (~0.3 s): import it where a Redis service is in use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from isbflow.isb.redis.acl import ADMIN, password_file
from isbflow.isb.redis.server import EmbeddedRedisError, RedisServerState, read_state, stop_redis

__all__ = ["EmbeddedRedisError", "RedisServerState", "describe", "read_state", "stop_redis", "url"]


def url(state: RedisServerState) -> str:
    """The server's URL, without credentials."""
    return f"redis://127.0.0.1:{state.port}"


def describe(data_dir: Path | str) -> dict[str, Any] | None:
    """The redis-server recorded under ``data_dir``: PID, URL, the admin's password file (never the
    password), log, persistence and whether it runs; None when none is recorded."""
    state = read_state(data_dir)
    if state is None:
        return None
    return {"pid": state.pid, "proc_start": state.proc_start, "url": url(state), "user": ADMIN,
            "password_file": str(password_file(data_dir, ADMIN)), "log": state.log,
            "persistence": state.persistence, "alive": state.alive()}
