"""Connecting to the Redis store: a ``redis.asyncio`` client for the admin or a role user."""

from __future__ import annotations

from pathlib import Path

import redis.asyncio

from isbflow.isb.redis.acl import ADMIN, password_file
from isbflow.isb.redis.server import HOST, EmbeddedRedisError, read_state


def connect(data_dir: Path | str, user: str = ADMIN) -> redis.asyncio.Redis:
    """A client of the embedded redis-server under ``data_dir`` logged in as ``user`` (its password
    from its owner-only file). Raises :class:`EmbeddedRedisError` when no server is recorded there."""
    state = read_state(data_dir)
    if state is None:
        raise EmbeddedRedisError(f"no redis-server is recorded under {Path(data_dir).absolute()}/redis: start one")
    pw = password_file(data_dir, user)
    if not pw.exists():
        raise EmbeddedRedisError(f"user {user} has no password under {pw.parent}: grant its pipeline first")
    return redis.asyncio.Redis(host=HOST, port=state.port, username=None if user == ADMIN else user,
                               password=pw.read_text().strip())
