"""The Redis store's fixture: a throwaway redis-server per test (tests.helpers.redis_server), which
fails the test, never skips it, on a machine without redis-server."""

from __future__ import annotations

import pytest

from tests.helpers.redis_server import running_redis


@pytest.fixture
def redis_server():
    with running_redis() as r:
        yield r
