"""Connecting to the ISB service: settings, where they come from, one clear error.

:class:`NatsSettings` is everything a client needs (URLs, credentials, TLS); it
is plain picklable data, so the driver can hand it to Spark executors.
:func:`resolve_settings` finds it, in this order:

1. an explicit URL (``--nats-url``) or the ``NATS_URL`` environment variable;
2. the spec's ``jetstream.url`` when it is not ``embedded``;
3. the embedded server's state under the data dir (``.isbflow/`` or
   ``ISBFLOW_HOME``), written by ``isbflow nats up``.

Credentials come from the URL (``nats://user:pass@host``), the spec's ``auth``
files, or ``NATS_CREDS`` / ``NATS_USER`` + ``NATS_PASSWORD`` / ``NATS_TOKEN``.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    import nats.aio.client

    from isbflow.spec.models import InterStepBufferService


class IsbUnreachable(Exception):
    """The ISB service could not be reached or refused us; the message names the URL."""


@dataclass(frozen=True)
class NatsSettings:
    servers: tuple[str, ...]
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_insecure: bool = False

    @property
    def display(self) -> str:
        """The server URLs with any password or token masked, safe for logs."""
        return ",".join(redact_url(u) for u in self.servers)

    def with_auth_from_urls(self) -> NatsSettings:
        """Move ``user:pass@`` out of the URLs into fields (nats-py wants one or the other)."""
        user, password, servers = self.user, self.password, []
        for u in self.servers:
            parts = urlsplit(u)
            if parts.username and not user:
                user, password = parts.username, parts.password
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
        return kw


def redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@")
    if parts.username:
        return url.replace(f"{parts.username}@", "***@")
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
) -> NatsSettings:
    """Where to find the ISB service (see module docstring for the order)."""
    url = nats_url or os.environ.get("NATS_URL")
    jet = service.spec.jetstream if service is not None else None
    if not url and jet is not None and jet.url != "embedded":
        url = jet.url
    if url:
        settings = settings_from_url(url)
    else:
        from isbflow.isb.server import read_state  # local import: server pulls in subprocess bits

        state = read_state(Path(data_dir) if data_dir else default_data_dir())
        if state is None:
            where = Path(data_dir) if data_dir else default_data_dir()
            raise IsbUnreachable(
                f"no ISB service: nothing running under {where}/ (start one with "
                "'isbflow nats up') and no --nats-url or NATS_URL given"
            )
        settings = settings_from_url(",".join(state.urls))
        if state.ca_file:
            settings = replace(settings, tls_ca=state.ca_file)
    env = os.environ
    if env.get("NATS_CREDS"):
        settings = replace(settings, creds_file=env["NATS_CREDS"])
    if env.get("NATS_USER"):
        settings = replace(settings, user=env["NATS_USER"], password=env.get("NATS_PASSWORD"))
    if env.get("NATS_TOKEN"):
        settings = replace(settings, token=env["NATS_TOKEN"])
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
    return settings


async def connect(settings: NatsSettings, name: str = "isbflow", timeout: float = 5.0) -> nats.aio.client.Client:
    """Connect, or raise :class:`IsbUnreachable` with one line naming the URL and the cause."""
    import nats
    from nats.errors import NoServersError

    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e) or type(e).__name__)

    try:
        # nats-py retries an auth refusal until it runs out of attempts; bound it.
        return await asyncio.wait_for(
            nats.connect(
                **settings.connect_kwargs(),
                name=name,
                connect_timeout=min(timeout, 2.0),
                max_reconnect_attempts=3 if len(settings.servers) > 1 else 1,
                reconnect_time_wait=0.2,
                error_cb=on_error,
                allow_reconnect=True,
            ),
            timeout,
        )
    except (NoServersError, OSError, asyncio.TimeoutError, ssl.SSLError) as e:
        if any("authoriz" in m.lower() for m in errors):
            raise IsbUnreachable(
                f"the ISB service at {settings.display} refused the connection: authorization violation "
                "(check the credentials)"
            ) from None
        cause = errors[-1] if errors else (str(e) or type(e).__name__)
        raise IsbUnreachable(f"cannot reach the ISB service at {settings.display}: {cause}") from None
    except Exception as e:  # nats-py raises its own types for auth refusals
        cause = str(e) or type(e).__name__
        if "authoriz" in cause.lower() or "auth" in type(e).__name__.lower():
            cause = f"authorization refused ({cause})"
        raise IsbUnreachable(f"the ISB service at {settings.display} refused the connection: {cause}") from None
