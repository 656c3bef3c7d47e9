"""Connecting to the ISB service: settings, where they come from, one clear error.

:class:`NatsSettings` is everything a client needs (URLs, credentials, TLS); it
is plain picklable data, so the driver can hand it to Spark executors.
:func:`resolve_settings` finds it, in this order:

1. an explicit URL (``--nats-url``) or the ``NATS_URL`` environment variable;
2. the spec's ``jetstream.url`` when it is not ``embedded``;
3. the embedded server's state under the data dir (``.isbflow/`` or
   ``ISBFLOW_HOME``), written by ``isbflow nats up``.

Credentials come from the URL (``nats://user:pass@host``), the spec's ``auth``
files, or ``NATS_CREDS`` / ``NATS_USER`` + ``NATS_PASSWORD`` / ``NATS_TOKEN``;
TLS files from ``NATS_TLS_CA`` / ``NATS_TLS_CERT`` + ``NATS_TLS_KEY``
(``NATS_TLS_INSECURE``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import nats
from nats.errors import AuthorizationError, NoServersError, SlowConsumerError

from isbflow.isb import roles
from isbflow.isb.errors import ConnectorOptionError
from isbflow.isb.server import EmbeddedNatsError, read_state, role_password_file

if TYPE_CHECKING:
    import nats.aio.client

    from isbflow.spec.models import InterStepBufferService


log = logging.getLogger(__name__)
T = TypeVar("T")


class IsbUnreachable(Exception):
    """The ISB service could not be reached or refused us; the message names the URL."""


@dataclass(frozen=True)
class NatsSettings:
    """Where and how to connect. Secrets never show in ``repr``/``display`` (logs, UIs)."""

    servers: tuple[str, ...]
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_insecure: bool = False
    #: where replies come back (``_INBOX_<user>`` for a role user, :func:`isbflow.isb.roles.inbox_prefix`)
    inbox_prefix: str | None = None

    @property
    def display(self) -> str:
        """The server URLs with any password or token masked, safe for logs."""
        return ",".join(redact_url(u) for u in self.servers)

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{k}={v!r}" for k, v in (
                ("servers", tuple(redact_url(u) for u in self.servers)), ("user", self.user),
                ("password", "***" if self.password else None), ("token", "***" if self.token else None),
                ("creds_file", self.creds_file), ("tls_ca", self.tls_ca), ("tls_cert", self.tls_cert),
                ("tls_key", self.tls_key), ("tls_insecure", self.tls_insecure), ("inbox_prefix", self.inbox_prefix),
            ) if v
        )
        return f"NatsSettings({shown})"

    def with_auth_from_urls(self) -> NatsSettings:
        """Move ``user:pass@`` out of the URLs into fields (nats-py wants one or the other)."""
        user, password, servers = self.user, self.password, []
        for u in self.servers:
            parts = urlsplit(u)
            if parts.username and not user:
                user = unquote(parts.username)
                password = unquote(parts.password) if parts.password is not None else None
            host = parts.hostname or ""
            if ":" in host:
                host = f"[{host}]"
            netloc = host + (f":{parts.port}" if parts.port else "")
            servers.append(urlunsplit((parts.scheme, netloc, parts.path, "", "")))
        if user and password is None and self.token is None and not self.password:
            # nats://token@host means a token
            return replace(self, servers=tuple(servers), token=user, user=None)
        return replace(self, servers=tuple(servers), user=user, password=password)

    def ssl_context(self) -> ssl.SSLContext | None:
        if not (self.tls_ca or self.tls_cert or any(u.startswith("tls://") for u in self.servers)):
            return None
        ctx = ssl.create_default_context(cafile=self.tls_ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        if self.tls_insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def connect_kwargs(self) -> dict:
        s = self.with_auth_from_urls()
        kw: dict = {"servers": list(s.servers)}
        if s.user:
            kw["user"], kw["password"] = s.user, s.password
        if s.token:
            kw["token"] = s.token
        if s.creds_file:
            kw["user_credentials"] = s.creds_file
        ctx = s.ssl_context()
        if ctx is not None:
            kw["tls"] = ctx
        # a role user may subscribe on its own inbox only (however the settings were made)
        prefix = s.inbox_prefix or (roles.inbox_prefix(s.user) if s.user and roles.is_role_user(s.user) else None)
        if prefix:
            kw["inbox_prefix"] = prefix
        return kw


def redact_url(url: str) -> str:
    """``nats://user:secret@host`` -> ``nats://user:***@host``; a bare token -> ``***@``."""
    parts = urlsplit(url)
    if parts.password is not None:
        return url.replace(f":{parts.password}@", ":***@", 1)
    if parts.username:
        return url.replace(f"{parts.username}@", "***@", 1)
    return url


def default_data_dir() -> Path:
    return Path(os.environ.get("ISBFLOW_HOME", ".isbflow"))


def settings_from_url(url: str) -> NatsSettings:
    return NatsSettings(servers=tuple(u.strip() for u in url.split(",") if u.strip()))


def _read_secret(path: str) -> str:
    return Path(path).read_text().strip()


def resolve_settings(
    nats_url: str | None = None,
    data_dir: Path | str | None = None,
    service: InterStepBufferService | None = None,
    role: str | None = None,
) -> NatsSettings:
    """Where to find the ISB service (see module docstring for the order).

    ``role`` (a user of :mod:`isbflow.isb.roles`: ``reader``, ``producer``, ``pipeline-<name>``;
    default the admin) picks the embedded server's user and its password file; an explicit URL,
    the environment or the spec's auth files win over it. A client logged in as a role user
    takes its inbox prefix (``_INBOX_<user>``), the only subjects it may subscribe on."""
    url = nats_url or os.environ.get("NATS_URL")
    jet = service.spec.jetstream if service is not None else None
    if not url and jet is not None and jet.url != "embedded":
        url = jet.url
    if url:
        settings = settings_from_url(url)
    else:
        try:
            state = read_state(Path(data_dir) if data_dir else default_data_dir())
        except EmbeddedNatsError as e:
            raise IsbUnreachable(str(e)) from None
        if state is None:
            where = Path(data_dir) if data_dir else default_data_dir()
            raise IsbUnreachable(
                f"no ISB service: nothing running under {where}/ (start one with "
                "'isbflow nats up') and no --nats-url or NATS_URL given"
            )
        if role is None or role == roles.ADMIN or not state.user:
            settings = settings_from_url(",".join(state.urls))
        else:
            pw = role_password_file(state.data_dir, role)
            if not pw.exists():
                raise IsbUnreachable(
                    f"the embedded ISB service under {state.data_dir} has no user {role!r} (no {pw}): "
                    "a pipeline's user is made when it is provisioned ('isbflow isb apply')")
            settings = replace(settings_from_url(",".join(state.plain_urls)), user=role, password=_read_secret(str(pw)))
        if state.ca_file:
            settings = replace(settings, tls_ca=state.ca_file)
    env = os.environ
    if env.get("NATS_CREDS"):
        settings = replace(settings, creds_file=env["NATS_CREDS"])
    if env.get("NATS_USER"):
        settings = replace(settings, user=env["NATS_USER"], password=env.get("NATS_PASSWORD"))
    if env.get("NATS_TOKEN"):
        settings = replace(settings, token=env["NATS_TOKEN"])
    if env.get("NATS_TLS_CA") or env.get("NATS_TLS_CERT"):
        settings = replace(settings, tls_ca=env.get("NATS_TLS_CA") or settings.tls_ca,
                           tls_cert=env.get("NATS_TLS_CERT") or None, tls_key=env.get("NATS_TLS_KEY") or None,
                           tls_insecure=env.get("NATS_TLS_INSECURE", "").lower() in ("1", "true", "yes"))
    if jet is not None:
        if jet.auth is not None:
            a = jet.auth
            if a.credsFile:
                settings = replace(settings, creds_file=a.credsFile)
            if a.userPasswordFile:
                user, _, password = _read_secret(a.userPasswordFile).partition(":")
                settings = replace(settings, user=user, password=password)
            if a.tokenFile:
                settings = replace(settings, token=_read_secret(a.tokenFile))
        if jet.tls is not None:
            settings = replace(
                settings,
                tls_ca=jet.tls.caFile or settings.tls_ca,
                tls_cert=jet.tls.certFile,
                tls_key=jet.tls.keyFile,
                tls_insecure=jet.tls.insecureSkipVerify,
            )
    user = settings.with_auth_from_urls().user
    if user and roles.is_role_user(user) and not settings.inbox_prefix:
        settings = replace(settings, inbox_prefix=roles.inbox_prefix(user))
    return settings


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
    errors: collections.deque[BaseException] = collections.deque(maxlen=8)
    connected = False
    drops: collections.Counter[object] = collections.Counter()

    async def on_error(e: BaseException) -> None:
        if isinstance(e, SlowConsumerError):  # counted for dropped_messages(); a read fails on it
            drops[e.sub] += 1
        if connected:
            log.warning("ISB service %s: %s", settings.display, e or type(e).__name__)
        else:
            errors.append(e)

    def refused(e: BaseException) -> bool:
        return isinstance(e, AuthorizationError) or "authoriz" in str(e).lower()

    try:
        nc = await asyncio.wait_for(
            nats.connect(
                **settings.connect_kwargs(),
                name=name,
                connect_timeout=min(timeout, 2.0),
                # nats-py retries the first connection like a reconnect; keep it short.
                max_reconnect_attempts=1,
                reconnect_time_wait=0.2,
                error_cb=on_error,
                allow_reconnect=True,
            ),
            timeout,
        )
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
    nc.options["max_reconnect_attempts"] = reconnect_attempts
    nc.isbflow_drops = drops
    return nc


def dropped_messages(nc: nats.aio.client.Client, sub: object) -> int:
    """Messages the client dropped on subscription ``sub`` because its pending limits were
    full (nats-py drops them and reports a slow consumer); 0 for a client not made by
    :func:`connect`."""
    return getattr(nc, "isbflow_drops", {}).get(sub, 0)


def settings_to_json(settings: NatsSettings) -> str:
    """The ``settings`` option value for ``settings``."""
    return json.dumps(dataclasses.asdict(settings))


def settings_from_json(text: str) -> NatsSettings:
    """Inverse of :func:`settings_to_json`."""
    try:
        d = json.loads(text)
        known = {f.name for f in dataclasses.fields(NatsSettings)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)}")
        d["servers"] = tuple(d["servers"])
        return NatsSettings(**d)
    except (ValueError, TypeError, KeyError) as e:
        raise ConnectorOptionError(
            f"option 'settings': not the JSON of NatsSettings ({e}); build it with "
            "isbflow.isb.connect.settings_to_json") from None


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
