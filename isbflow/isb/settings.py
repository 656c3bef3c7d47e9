"""ISB service client settings: plain data, and where they come from.

:class:`NatsSettings` is everything a client needs (URLs, credentials, TLS); it
is plain picklable data, so the driver can hand it to Spark executors and to
the processes Spark forks per micro-batch commit. This module imports no NATS
client: unpickling a writer's options in such a process costs no ``nats``
import (:mod:`isbflow.isb.connect` holds the connections and re-exports these
names). :func:`resolve_settings` finds the settings, in this order:

1. an explicit URL (``--nats-url``) or the ``NATS_URL`` environment variable;
2. the spec's ``jetstream.url`` when it is not ``embedded``;
3. the embedded server's state under the data dir (``.isbflow/`` or
   ``ISBFLOW_HOME``), written by ``isbflow nats up``.

Credentials come from the URL (``nats://user:pass@host``), the spec's ``auth``
files (only from the secrets folder, :func:`isbflow.spec.paths.secrets_dir`;
relative to the data dir), or ``NATS_CREDS`` / ``NATS_USER`` + ``NATS_PASSWORD`` / ``NATS_TOKEN``;
TLS files from ``NATS_TLS_CA`` / ``NATS_TLS_CERT`` + ``NATS_TLS_KEY``
(``NATS_TLS_INSECURE``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import ssl
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar
from urllib.parse import unquote, urlsplit, urlunsplit

from isbflow.isb import roles
from isbflow.isb.errors import ConnectorOptionError
from isbflow.isb.server import EmbeddedNatsError, read_state, role_password_file
from isbflow.spec.paths import SecretFileError, secret_file

if TYPE_CHECKING:
    from isbflow.spec.models import InterStepBufferService


class IsbUnreachable(Exception):
    """The ISB service could not be reached or refused us; the message names the URL."""


class IsbNotStarted(IsbUnreachable):
    """The spec's service is one isbflow starts (``redis.native``) and none was started under the
    data dir: nothing of its pipelines can be running there."""


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


@dataclass(frozen=True)
class RedisSettings:
    """Where and how to reach a Redis store (``spec.redis``): plain picklable data, like
    :class:`NatsSettings`, handed the same way to Spark executors. ``url`` carries no credentials
    (``redis://host:port/db``, ``rediss://`` for TLS); the user and password are fields, and the
    password never shows in ``repr``/``display``."""

    url: str
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_ca: str | None = None

    #: the store these settings reach (:func:`settings_to_json` records it)
    store: ClassVar[str] = "redis"

    @property
    def display(self) -> str:
        return redact_url(self.url)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in (
            ("url", self.display), ("user", self.user), ("password", "***" if self.password else None),
            ("tls_ca", self.tls_ca)) if v)
        return f"RedisSettings({shown})"


#: the settings of either store
IsbSettings = NatsSettings | RedisSettings


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
) -> IsbSettings:
    """Where to find the ISB service (see module docstring for the order).

    ``role`` (a user of :mod:`isbflow.isb.roles`: ``reader``, ``producer``, ``pipeline-<name>``;
    default the admin) picks the embedded server's user and its password file; an explicit URL,
    the environment or the spec's auth files win over it. A client logged in as a role user
    takes its inbox prefix (``_INBOX_<user>``), the only subjects it may subscribe on. A Redis
    service (``spec.redis``) gets :class:`RedisSettings` (:func:`resolve_redis_settings`)."""
    if service is not None and service.store == "redis":
        return resolve_redis_settings(service, data_dir, role)
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

            def secret(field: str, path: str) -> str:
                try:
                    return str(secret_file(path, f"jetstream.auth.{field}", data_dir))
                except SecretFileError as e:
                    raise IsbUnreachable(f"ISB service {service.name!r}: {e}") from None

            if a.credsFile:
                settings = replace(settings, creds_file=secret("credsFile", a.credsFile))
            if a.userPasswordFile:
                user, _, password = _read_secret(secret("userPasswordFile", a.userPasswordFile)).partition(":")
                settings = replace(settings, user=user, password=password)
            if a.tokenFile:
                settings = replace(settings, token=_read_secret(secret("tokenFile", a.tokenFile)))
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


def resolve_redis_settings(service: InterStepBufferService, data_dir: Path | str | None = None,
                           role: str | None = None) -> RedisSettings:
    """The settings of a Redis service (``spec.redis``): ``native`` from the embedded redis-server
    recorded under the data dir (``isbflow isb up -f SPEC``), logged in as ``role``'s ACL user (its
    password file, made when the pipeline is provisioned) or as the admin; ``external`` from its
    ``url``, ``user`` and ``password.file`` (in the secrets folder). ``REDIS_URL``, ``REDIS_USER`` and
    ``REDIS_PASSWORD`` override them, as ``NATS_URL`` does JetStream's."""
    redis = service.spec.redis
    assert redis is not None
    where = Path(data_dir) if data_dir else default_data_dir()
    env = os.environ
    if env.get("REDIS_URL"):  # a launched driver's (isbflow.steps.driver.settings_env)
        return RedisSettings(url=env["REDIS_URL"], user=env.get("REDIS_USER") or None,
                             password=env.get("REDIS_PASSWORD") or None)
    if redis.native is not None:
        # lazy: JetStream-only callers never import redis-py
        from isbflow.isb.redis.acl import ADMIN, password_file
        from isbflow.isb.redis.server import EmbeddedRedisError
        from isbflow.isb.redis.server import read_state as read_redis_state

        try:
            state = read_redis_state(where)
        except EmbeddedRedisError as e:
            raise IsbUnreachable(str(e)) from None
        if state is None:
            raise IsbNotStarted(f"no Redis ISB service: nothing running under {where}/redis (start it with "
                                 f"'isbflow isb up -f SPEC' for service {service.name!r})")
        user = role if role not in (None, roles.ADMIN, ADMIN) else ADMIN
        pw = password_file(where, user)
        if not pw.exists():
            raise IsbUnreachable(f"the Redis ISB service under {where} has no user {user!r} (no {pw}): a pipeline's "
                                 "user is made when it is provisioned ('isbflow isb apply')")
        settings = RedisSettings(url=f"redis://127.0.0.1:{state.port}/0", user=None if user == ADMIN else user,
                                 password=_read_secret(str(pw)))
    else:
        ext = redis.external
        assert ext is not None
        url = ext.url if "://" in ext.url else f"redis://{ext.url}"
        password = None
        if ext.password is not None and ext.password.file:
            try:
                password = _read_secret(str(secret_file(ext.password.file, "redis.external.password.file", data_dir)))
            except SecretFileError as e:
                raise IsbUnreachable(f"ISB service {service.name!r}: {e}") from None
        elif ext.password is not None:
            env_pw = os.environ.get("REDIS_PASSWORD")
            if env_pw is None:
                raise IsbUnreachable(
                    f"ISB service {service.name!r}: redis.external.password.connectionId "
                    f"{ext.password.connectionId!r} is an Airflow connection; outside Airflow set REDIS_PASSWORD")
            password = env_pw
        settings = RedisSettings(url=url, user=ext.user, password=password)
    if env.get("REDIS_USER"):
        settings = replace(settings, user=env["REDIS_USER"])
    if env.get("REDIS_PASSWORD"):
        settings = replace(settings, password=env["REDIS_PASSWORD"])
    return settings


def settings_to_json(settings: IsbSettings) -> str:
    """The ``settings`` option value for ``settings`` (either store's)."""
    d = dataclasses.asdict(settings)
    if isinstance(settings, RedisSettings):
        d["store"] = RedisSettings.store
    return json.dumps(d)


def settings_from_json(text: str) -> IsbSettings:
    """Inverse of :func:`settings_to_json`."""
    try:
        d = json.loads(text)
        cls: type = RedisSettings if d.pop("store", "jetstream") == RedisSettings.store else NatsSettings
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)}")
        if cls is NatsSettings:
            d["servers"] = tuple(d["servers"])
        return cls(**d)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ConnectorOptionError(
            f"option 'settings': not the JSON of NatsSettings or RedisSettings ({e}); build it with "
            "isbflow.isb.settings.settings_to_json") from None
