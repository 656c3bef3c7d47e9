"""Connecting to the ISB service: one clear error, one way to hold a connection.

The settings (:class:`NatsSettings`, :func:`resolve_settings` and their JSON form) live in
:mod:`isbflow.isb.settings`, which imports no NATS client; they are re-exported here, so
callers import them from either module.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import logging
import os
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import nats
from nats.errors import AuthorizationError, NoServersError, SlowConsumerError

from isbflow.isb.settings import (  # noqa: F401 - the settings' names, re-exported for callers of connect
    IsbSettings,
    IsbUnreachable,
    NatsSettings,
    RedisSettings,
    default_data_dir,
    redact_url,
    resolve_settings,
    settings_from_json,
    settings_from_url,
    settings_to_json,
)

if TYPE_CHECKING:
    import nats.aio.client


log = logging.getLogger(__name__)
T = TypeVar("T")


async def connect(
    settings: NatsSettings,
    name: str = "isbflow",
    timeout: float = 5.0,
    reconnect_attempts: int = 60,
) -> nats.aio.client.Client:
    """Connect, or raise :class:`IsbUnreachable` with one line naming the URL and the cause.

    The first connection gives up after ``timeout`` seconds (a refused login is
    not retried into the timeout). Once connected, the client rides out server
    restarts: it reconnects up to ``reconnect_attempts`` times per server
    (``-1``: forever), and connection errors from then on are logged.
    """
    if isinstance(settings, RedisSettings):
        return await _open_redis(settings, name, timeout)
    errors: collections.deque[BaseException] = collections.deque(maxlen=8)
    connected = False
    drops: collections.Counter[object] = collections.Counter()
    nc = nats.aio.client.Client()

    async def on_error(e: BaseException) -> None:
        if isinstance(e, SlowConsumerError):  # counted for dropped_messages(); a read fails on it
            drops[e.sub] += 1
        if connected:
            log.warning("ISB service %s: %s", settings.display, e or type(e).__name__)
        else:
            errors.append(e)
            if refused(e):  # nats-py would retry a refused login until the timeout: the next error ends it
                nc.options["allow_reconnect"] = False

    def refused(e: BaseException) -> bool:
        return isinstance(e, AuthorizationError) or "authoriz" in str(e).lower()

    attempt = asyncio.ensure_future(nc.connect(
        **settings.connect_kwargs(),
        name=name,
        connect_timeout=min(timeout, 2.0),
        # nats-py retries the first connection like a reconnect; keep it short.
        max_reconnect_attempts=1,
        reconnect_time_wait=0.2,
        error_cb=on_error,
        allow_reconnect=True,
    ))
    try:
        await _within(attempt, timeout, nc)
    except Exception as e:  # nats-py raises its own types, OSError, TimeoutError, ssl errors
        causes = [*errors, e]
        if any(refused(c) for c in causes):
            raise IsbUnreachable(
                f"the ISB service at {settings.display} refused the connection: authorization violation "
                "(check the user and password, token or creds file)"
            ) from None
        tls = next((c for c in causes if isinstance(c, ssl.SSLError)), None)
        if tls is not None:
            why = getattr(tls, "verify_message", None)
            why = f"certificate verify failed: {why}" if why else (tls.reason or str(tls))
            raise IsbUnreachable(
                f"cannot reach the ISB service at {settings.display}: TLS failed: {why} "
                "(check the CA file and that the URL's host is in the server certificate)"
            ) from None
        # the last error of a connection attempt says more than nats-py's final "no servers"
        cause = next((c for c in reversed(causes) if str(c) and not isinstance(c, NoServersError)), e)
        text = str(cause) or ("timed out" if isinstance(cause, asyncio.TimeoutError) else type(cause).__name__)
        raise IsbUnreachable(f"cannot reach the ISB service at {settings.display}: {text}") from None
    connected = True
    nc.options["allow_reconnect"] = True
    nc.options["max_reconnect_attempts"] = reconnect_attempts
    nc.isbflow_drops = drops
    return nc


async def _open_redis(settings: RedisSettings, name: str, timeout: float):
    """The Redis store of ``settings`` (:class:`isbflow.isb.redis.store.RedisStore`): the connection
    of a Redis-backed pipeline, used where a nats-py client is used for JetStream (its buckets
    through :mod:`isbflow.isb.control`, its buffers through :mod:`isbflow.isb.buffers`)."""
    # lazy: JetStream-only processes never import redis-py
    from isbflow.isb.redis.connection import StoreRefused, StoreUnreachable, open_store

    try:
        return await open_store(settings.url, settings.user, settings.password, tls_ca=settings.tls_ca,
                                name=name, timeout=timeout)
    except StoreRefused as e:
        raise IsbUnreachable(f"the ISB service at {settings.display} refused the connection: {e}") from None
    except StoreUnreachable as e:
        raise IsbUnreachable(f"cannot reach the ISB service at {settings.display}: {e}") from None


async def _within(attempt: asyncio.Future, timeout: float, nc: nats.aio.client.Client) -> None:
    """Await nats-py's first connection for at most ``timeout`` seconds, and then really stop it.

    ``asyncio.wait_for`` cancels the attempt and waits for it to end, but nats-py's connect
    loop swallows a cancellation that lands in some of its awaits (``_flush_pending``,
    ``_close``) and then retries forever: CI saw one refused login hang a test for 600 s. So
    the loop is also told not to retry (its next error raises) and cancelled again until it ends.
    """
    try:
        done, _ = await asyncio.wait({attempt}, timeout=timeout)
    except asyncio.CancelledError:
        attempt.cancel()
        raise
    if done:
        attempt.result()
        return
    nc.options["allow_reconnect"] = False
    for _ in range(100):  # each cancel lands in the loop's next await; 5 s at most
        attempt.cancel()
        done, _ = await asyncio.wait({attempt}, timeout=0.05)
        if done:
            break
    if attempt.done() and not attempt.cancelled():
        if attempt.exception() is not None:
            raise attempt.exception()  # type: ignore[misc]
        await nc.close()  # it connected as the time ran out: the caller gets the timeout, not a leak
    raise TimeoutError


def dropped_messages(nc: nats.aio.client.Client, sub: object) -> int:
    """Messages the client dropped on subscription ``sub`` because its pending limits were
    full (nats-py drops them and reports a slow consumer); 0 for a client not made by
    :func:`connect`."""
    return getattr(nc, "isbflow_drops", {}).get(sub, 0)


# ------------------------------------------------------------------ sessions: one way to hold a connection


@contextlib.asynccontextmanager
async def session(settings: NatsSettings, name: str = "isbflow", **kwargs) -> AsyncIterator[nats.aio.client.Client]:
    """``async with session(settings) as nc``: a connection closed on the way out, whatever happens."""
    nc = await connect(settings, name=name, **kwargs)
    try:
        yield nc
    finally:
        await nc.close()


def run_with(settings: NatsSettings, fn: Callable[[nats.aio.client.Client], Awaitable[T]],
             name: str = "isbflow") -> T:
    """For a caller that is not async: ``fn(nc)`` on a fresh connection and event loop, then both closed."""

    async def go() -> T:
        async with session(settings, name=name) as nc:
            return await fn(nc)

    return asyncio.run(go())


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Close a private event loop the way ``asyncio.run`` does: finish cancelled tasks first
    (nats-py's ``close`` cancels its reader/flusher tasks without waiting for them)."""
    try:
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()


class SyncSession:
    """A long-lived connection for a caller that is not async (the driver's bookkeeping, a
    Spark reader on the driver): its own event loop, connected on first use and again
    after the connection closed; ``run(...)`` runs a coroutine on it."""

    def __init__(self, settings: NatsSettings, name: str = "isbflow"):
        self.settings, self.name = settings, name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._nc: nats.aio.client.Client | None = None

    @property
    def nc(self) -> nats.aio.client.Client:
        """The connection (opened when missing or closed)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        if self._nc is None or self._nc.is_closed:
            self._nc = self._loop.run_until_complete(connect(self.settings, name=self.name))
        return self._nc

    def run(self, work: Awaitable[T] | Callable[[nats.aio.client.Client], Awaitable[T]]) -> T:
        """Run a coroutine (made with :attr:`nc`) or ``work(nc)`` on the session's loop."""
        nc = self.nc
        assert self._loop is not None
        return self._loop.run_until_complete(work(nc) if callable(work) else work)

    def close(self) -> None:
        if self._loop is not None:
            try:
                if self._nc is not None and not self._nc.is_closed:
                    self._loop.run_until_complete(self._nc.close())
            finally:
                close_loop(self._loop)
        self._loop = self._nc = None

    def __enter__(self) -> SyncSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: :func:`run_kept`'s connections: (pid, settings, name) -> [lock, session, last used (monotonic)]
_KEPT: dict[tuple, list] = {}
_KEPT_LOCK = threading.Lock()
#: seconds after which :func:`run_kept` connects anew instead of using its kept connection: while no
#: call runs, nothing answers the server's pings (every 2 minutes), so after a few it drops the client
KEPT_IDLE_S = 60.0


def run_kept(settings: NatsSettings, fn: Callable[[nats.aio.client.Client], Awaitable[T]],
             name: str = "isbflow") -> T:
    """``fn(nc)`` for a caller that is not async and calls again and again (a sink's commit every
    micro-batch): on a connection this process keeps per ``settings`` and ``name`` (used within
    :data:`KEPT_IDLE_S` of its last call, else connected anew), one call at a time (callers in other
    threads wait). :func:`run_with` connects and closes every time; measured against a local server
    with auth (one ledger record per call, 200 calls): 2.8 ms of the caller's CPU and 1.3 ms of the
    server's a call, kept 1.0 and 0.6. A kept connection the server has gone from (restarted) is
    closed first; a call that fails on it with a NATS or socket error closes it and runs once more
    on a fresh one, whose error, if any, is raised: ``fn`` must be safe to run twice (the ledger's
    records are unions). Its own errors (:class:`~isbflow.isb.errors.LedgerFull`) are raised at once."""
    key = (os.getpid(), settings, name)  # a forked child never uses its parent's socket
    with _KEPT_LOCK:
        kept = _KEPT.get(key) or _KEPT.setdefault(key, [threading.Lock(), SyncSession(settings, name), 0.0])
    lock, sess = kept[0], kept[1]
    with lock:
        try:
            if time.monotonic() - kept[2] > KEPT_IDLE_S or not sess.run(_still_connected):
                sess.close()
            try:
                return sess.run(fn)
            except (nats.errors.Error, OSError) as e:  # the connection's failures (timeouts are OSErrors)
                log.info("%s: the kept connection to %s failed (%s); connecting again", name, settings.display, e)
                sess.close()
            return sess.run(fn)
        finally:
            kept[2] = time.monotonic()


async def _still_connected(nc: nats.aio.client.Client) -> bool:
    """Whether ``nc`` is still connected once its client has read what arrived while no call ran
    (a server that went away: its end of the socket, seen within a few turns of the loop)."""
    for _ in range(5):
        await asyncio.sleep(0)
    return nc.is_connected


@atexit.register
def _close_kept() -> None:
    for _, sess, _ in list(_KEPT.values()):
        with contextlib.suppress(Exception):
            sess.close()
    _KEPT.clear()
