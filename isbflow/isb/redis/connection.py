"""Opening a Redis store from a URL and credentials (the settings of ``spec.redis``).

:func:`open_store` connects and checks the login with a ``PING`` before it returns, so a wrong
password or an unreachable server fails at once, with one line naming the URL (never the
password), as a connection to JetStream does. The caller maps the two errors onto its own
(``isbflow.isb.connect`` turns both into ``IsbUnreachable``).
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import redis.asyncio
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from isbflow.isb.redis.store import RedisStore


class StoreRefused(ConnectionRefusedError):
    """The server refused the login (wrong user or password, or an ACL without PING)."""


class StoreUnreachable(ConnectionError):
    """The server could not be reached within the timeout."""


async def open_store(url: str, user: str | None = None, password: str | None = None, *,
                     tls_ca: str | None = None, name: str = "isbflow", timeout: float = 5.0) -> RedisStore:
    """A :class:`RedisStore` on ``url`` logged in as ``user`` (None: the default user) with
    ``password``; raises :class:`StoreRefused` or :class:`StoreUnreachable` (module doc). ``name``
    is the caller's label, kept for symmetry with the JetStream connection (unused)."""
    # no client name: CLIENT SETNAME is a command a role user is not granted
    kw = {"username": user, "password": password, "socket_connect_timeout": timeout,
          "socket_timeout": max(timeout, 30.0)}
    if urlsplit(url).scheme == "rediss" and tls_ca:
        kw["ssl_ca_certs"] = tls_ca
    client = redis.asyncio.Redis.from_url(url, **kw)
    try:
        await asyncio.wait_for(client.ping(), timeout)
    except (AuthenticationError, AuthenticationWrongNumberOfArgsError) as e:
        await client.aclose()
        raise StoreRefused(f"authorization failed ({e}): check the user and password") from None
    except ResponseError as e:  # e.g. NOPERM: the user may not even PING
        await client.aclose()
        raise StoreRefused(f"the server refused the login: {e}") from None
    except (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError) as e:
        await client.aclose()
        raise StoreUnreachable(str(e) or type(e).__name__) from None
    return RedisStore(client)
