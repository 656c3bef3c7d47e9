"""The ``InterStepBufferService`` kind: the store the buffers live on, JetStream or Redis.

Fields follow Numaflow's (``jetstream.url``, ``settings``, ``bufferConfig.stream``;
``redis.native``, ``redis.external``); Numaflow's numeric ``retention``/``storage`` codes are
read as Numaflow means them and its fields isbflow has no use for are refused
(:mod:`isbflow.spec.numaflow`). A service takes one store: ``jetstream`` (the default) or ``redis``.
"""

from __future__ import annotations

import re
import shlex
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from isbflow.spec.fields import Duration, Metadata, Size, SpecModel
from isbflow.spec.numaflow import (
    REDIS_SETTINGS,
    REDIS_SETTINGS_REFUSED,
    RETENTION_CODES,
    STORAGE_CODES,
    numeric_code,
)


class Retention(StrEnum):
    """JetStream's retention policy of a stream."""

    LIMITS = "Limits"
    INTEREST = "Interest"
    WORK_QUEUE = "WorkQueue"


class Storage(StrEnum):
    """Where JetStream keeps a stream's messages."""

    FILE = "file"
    MEMORY = "memory"


class StreamConfig(SpecModel):
    """``bufferConfig.stream``: how each edge-partition stream is configured.

    ``retention`` and ``storage`` also take Numaflow's codes (0 Limits, 1 Interest,
    2 WorkQueue; 0 file, 1 memory)."""

    retention: Annotated[Retention, BeforeValidator(numeric_code(RETENTION_CODES, "retention"),
                                                    json_schema_input_type=Retention | Literal[0, 1, 2])] = \
        Retention.LIMITS
    """``Limits``, ``Interest`` or ``WorkQueue`` (or Numaflow's 0, 1, 2). Default ``Limits``."""
    maxMsgs: StrictInt = Field(default=-1, ge=-1)
    """The most messages a stream keeps; -1: no bound. Default -1."""
    maxAge: Duration = 72 * 3600.0
    """Messages older than this are removed, a duration (``72h``) or seconds. Default 72h."""
    maxBytes: Size = -1
    """The most bytes a stream keeps, bytes or a size (``512MiB``); -1: no bound. Default -1."""
    storage: Annotated[Storage, BeforeValidator(numeric_code(STORAGE_CODES, "storage"),
                                                json_schema_input_type=Storage | Literal[0, 1])] = Storage.FILE
    """``file`` or ``memory`` (or Numaflow's 0, 1). Default ``file``."""
    replicas: StrictInt = Field(default=1, ge=1, le=5)
    """Copies of each stream on the JetStream cluster, 1 to 5. Default 1."""
    duplicates: Duration = 120.0
    """The window in which a message id published twice is stored once, a duration or seconds. Default 2m."""


class DeadLetterConfig(StreamConfig):
    """``bufferConfig.deadLetter``: the dead-letter stream's own settings (isbflow only; the same
    fields as ``bufferConfig.stream``, none taken from it).

    Defaults: file storage, ``Limits`` retention, ``maxMsgs`` 100,000, ``maxBytes`` 256MiB,
    ``maxAge`` 7 days, duplicates 2m; ``replicas`` follows ``bufferConfig.stream.replicas``
    unless set. A bounded dead-letter stream refuses new letters when full (discard ``new``,
    whatever the retention), so a step fails loudly instead of a letter vanishing; ``maxAge``
    still expires letters older than it.
    """

    maxMsgs: StrictInt = Field(default=100_000, ge=-1)
    """The most dead letters kept; -1: no bound. Default 100000."""
    maxAge: Duration = 7 * 24 * 3600.0
    """Dead letters older than this are removed, a duration or seconds. Default 7 days."""
    maxBytes: Size = 256 * 1024**2
    """The most bytes of dead letters kept, bytes or a size; -1: no bound. Default 256MiB."""
    replicas: StrictInt | None = Field(default=None, ge=1, le=5)
    """Copies of the dead-letter stream, 1 to 5. Default: ``bufferConfig.stream.replicas``."""


class BufferConfig(SpecModel):
    """``bufferConfig``: the buffers' stream settings (``stream``) and the dead-letter stream's
    (``deadLetter``, :class:`DeadLetterConfig`). Numaflow's ``consumer``, ``otBucket``
    and ``procBucket`` are refused (:data:`isbflow.spec.numaflow.FIELDS` says why)."""

    stream: StreamConfig = Field(default_factory=StreamConfig)
    """How every buffer's stream is configured."""
    deadLetter: DeadLetterConfig = Field(default_factory=DeadLetterConfig)
    """How the pipeline's dead-letter stream is configured."""

    @property
    def dead_letter_replicas(self) -> int:
        """The dead-letter stream's replicas: its own when set, else the buffers'."""
        return self.deadLetter.replicas or self.stream.replicas


class JetStreamSettings(SpecModel):
    """Server settings: ``max_payload`` bounds frames and each stream's message size (always
    applied); ``max_memory_store``/``max_file_store`` configure the embedded nats-server when
    isbflow starts it, and are refused for an external ``jetstream.url`` (that server's own
    config sets them)."""

    max_payload: Size = Field(default=8 * 1024 * 1024, gt=0)
    """The largest message, bytes or a size (``8MiB``): bounds frames and every stream. Default 8MiB."""
    max_memory_store: Size = 1024**3
    """The embedded server's memory store, bytes or a size. Default 1GiB; not for an external ``url``."""
    max_file_store: Size = 10 * 1024**3
    """The embedded server's disk store, bytes or a size. Default 10GiB; not for an external ``url``."""


class TLSConfig(SpecModel):
    """TLS to the ISB service, by files."""

    caFile: str | None = None
    """The CA certificate (PEM) the server's certificate is checked against."""
    certFile: str | None = None
    """The client certificate (PEM), when the server asks for one."""
    keyFile: str | None = None
    """The private key (PEM) of ``certFile``."""
    insecureSkipVerify: bool = False
    """Skip checking the server's certificate. Default false."""


class AuthConfig(SpecModel):
    """Credentials by reference only: an Airflow connection id, a creds file, or a
    file holding ``user:password`` / a token. Secrets never sit in a spec."""

    connectionId: str | None = None
    """An Airflow connection id holding the credentials."""
    credsFile: str | None = None
    """A NATS ``.creds`` file (JWT and NKey seed)."""
    userPasswordFile: str | None = None
    """A file holding ``user:password``."""
    tokenFile: str | None = None
    """A file holding a token."""


def _persistence(value: Any) -> Any:
    if isinstance(value, dict):
        raise ValueError("must be true or false (KV buckets on disk or in memory); Numaflow's persistence "
                         "(storageClassName, accessMode, volumeSize) is a Kubernetes volume: bound the embedded "
                         "server's disk with settings.max_file_store instead")
    return value


def _tls(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("must be a mapping of files (caFile, certFile, keyFile, insecureSkipVerify): isbflow "
                         "generates no certificates as Numaflow's 'tls: true' does; start the embedded server "
                         "with 'isbflow nats up --tls-cert ... --tls-key ... --tls-ca ...'")
    return value


class JetStreamService(SpecModel):
    """The ISB service. ``replicas`` (optional) is the number of JetStream servers it must have:
    ``isbflow isb apply`` checks the running service has at least that many before changing
    anything (isbflow starts no servers from it); each stream's own replica count is
    ``bufferConfig.stream.replicas``, at most ``replicas``."""

    url: str = "embedded"
    """``embedded`` (the nats-server isbflow starts under the data dir) or ``nats://host:port``, several
    comma separated. Default ``embedded``."""
    replicas: StrictInt | None = Field(default=None, ge=1, le=5)
    """The JetStream servers the service must have, 1 to 5 (checked by ``isbflow isb apply``). Default: not
    checked."""
    persistence: Annotated[bool, BeforeValidator(_persistence)] = True
    """KV buckets on disk (true) or in memory (false). Default true."""
    settings: JetStreamSettings = Field(default_factory=JetStreamSettings)
    """Server settings (a mapping, or Numaflow's YAML string)."""
    bufferConfig: BufferConfig = Field(default_factory=BufferConfig)
    """The buffers' and the dead-letter stream's settings (a mapping, or Numaflow's YAML string)."""
    tls: Annotated[TLSConfig | None, BeforeValidator(_tls)] = None
    """TLS to the service. Default: none (plain TCP)."""
    auth: AuthConfig | None = None
    """Where the credentials are (never in the spec). Default: the embedded server's own."""
    encryption: bool = False
    """Encrypt the embedded server's JetStream store at rest (key generated into
    ``<data dir>/nats/jetstream.key``, owner-only). Only with ``url: embedded``: nats-server reports
    encryption to no client, so an external server's cannot be checked. Default false."""
    cipher: Literal["chachapoly", "aes"] = "chachapoly"
    """isbflow only: the cipher of ``encryption`` (nats-server's ``jetstream { cipher }``),
    ``chachapoly`` or ``aes``. Default ``chachapoly``."""

    @field_validator("settings")
    @classmethod
    def _server_settings(cls, v: JetStreamSettings, info: ValidationInfo) -> JetStreamSettings:
        url = info.data.get("url")
        fixed = sorted(f for f in ("max_memory_store", "max_file_store") if f in v.model_fields_set)
        if url is not None and url != "embedded" and fixed:
            raise ValueError(f"{', '.join(fixed)}: configure the embedded nats-server isbflow starts; the server "
                             f"at jetstream.url sets them in its own config (jetstream {{ {fixed[0]}: ... }}): "
                             "remove them here")
        return v

    @model_validator(mode="after")
    def _encryption(self) -> JetStreamService:
        if "cipher" in self.model_fields_set and not self.encryption:
            raise ValueError("cipher is set but encryption is false: set encryption: true, or remove cipher")
        if self.encryption and self.url != "embedded":
            raise ValueError(
                f"encryption: true with jetstream.url {self.url}: encryption at rest is that server's own "
                "setting (jetstream { cipher: ..., key: ... } in its config), and nats-server reports it to no "
                "client (not in INFO, $JS.API.INFO, stream info, /varz or /jsz), so isbflow cannot check it: "
                "configure it on that server and remove encryption here")
        return self

    @model_validator(mode="after")
    def _stream_replicas(self) -> JetStreamService:
        for name, wanted in (("stream", self.bufferConfig.stream.replicas),
                             ("deadLetter", self.bufferConfig.deadLetter.replicas)):
            if self.replicas is not None and wanted is not None and wanted > self.replicas:
                raise ValueError(f"bufferConfig.{name}.replicas is {wanted} but replicas (JetStream servers) is "
                                 f"{self.replicas}: a stream cannot have more replicas than the service has "
                                 "servers")
        return self

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if v == "embedded":
            return v
        for part in v.split(","):
            part = part.strip()
            if not re.match(r"^(nats|tls|ws|wss)://[A-Za-z0-9.\-\[\]:@%_]+\Z", part):
                raise ValueError(
                    f"{part!r} is not a NATS URL: use 'embedded' or nats://host:port[,nats://...]"
                )
        return v


def _redis_persistence(value: Any) -> Any:
    if isinstance(value, dict):
        raise ValueError("must be true or false (the append-only file on or off); Numaflow's persistence "
                         "(storageClassName, accessMode, volumeSize) is a Kubernetes volume: the embedded "
                         "redis-server keeps its files under <data dir>/redis")
    return value


def redis_directives(text: str) -> list[tuple[str, str]]:
    """The ``(name, value)`` directives of ``settings.redis`` (redis.conf lines; ``#`` comments and blank
    lines skipped), each one :data:`isbflow.spec.numaflow.REDIS_SETTINGS` allows. Raises ValueError naming
    the line and why a directive is refused."""
    out: list[tuple[str, str]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"line {n} of the string ({line.strip()[:60]!r})"
        try:
            words = shlex.split(line, comments=False)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if any(not ch.isprintable() for w in words for ch in w):
            raise ValueError(f"{where}: control characters are not allowed")
        name, value = words[0].lower(), " ".join(words[1:])
        refused = next((why for k, why in REDIS_SETTINGS_REFUSED.items()
                        if name == k or (k.endswith("-") and name.startswith(k))), None)
        if refused is not None:
            raise ValueError(f"{where}: {name} is refused: {refused}")
        if name not in REDIS_SETTINGS:
            raise ValueError(f"{where}: {name} is not a setting isbflow passes to redis-server "
                             f"(allowed: {', '.join(REDIS_SETTINGS)})")
        if not value:
            raise ValueError(f"{where}: {name} needs a value")
        if name in (k for k, _ in out):
            raise ValueError(f"{where}: {name} is set twice")
        out.append((name, value))
    return out


class RedisSettings(SpecModel):
    """``native.settings``: redis.conf lines for the embedded redis-server. Numaflow's ``master``,
    ``replica`` and ``sentinel`` are refused (isbflow starts one server)."""

    redis: str = ""
    """redis.conf lines, one directive a line, as Numaflow writes them (``redis: |`` and a block), e.g.
    ``maxmemory 2gb``. Only settings that leave alone the address, credentials, files and persistence
    isbflow sets are taken (:data:`isbflow.spec.numaflow.REDIS_SETTINGS`); ``bind``, ``port``,
    ``requirepass``, ``rename-command`` and the like are refused, saying why. Applied with ``CONFIG SET``
    by ``isbflow isb up``. Default: none."""

    @field_validator("redis")
    @classmethod
    def _lines(cls, v: str) -> str:
        redis_directives(v)
        return v

    @property
    def directives(self) -> list[tuple[str, str]]:
        return redis_directives(self.redis)


class NativeRedis(SpecModel):
    """``redis.native``: a redis-server isbflow starts on 127.0.0.1 under the data dir
    (``isbflow isb up -f SPEC``), with a generated password and ``maxmemory-policy noeviction``."""

    persistence: Annotated[bool, BeforeValidator(_redis_persistence)] = True
    """The append-only file on (true: a restart keeps the buffers) or off (false: a restart starts empty,
    and every buffer reads as lost). Default true."""
    fsync: Literal["everysec", "always"] = "everysec"
    """isbflow only: ``appendfsync`` with ``persistence: true``: ``everysec`` (a crash of the machine may
    lose the last second of writes) or ``always`` (every write on disk before it is answered; slower).
    Default ``everysec``."""
    settings: RedisSettings = Field(default_factory=RedisSettings)
    """redis.conf lines for the server (``settings.redis``). Default: none."""

    @model_validator(mode="after")
    def _fsync(self) -> NativeRedis:
        if "fsync" in self.model_fields_set and not self.persistence:
            raise ValueError("fsync is set but persistence is false (no append-only file to sync): set "
                             "persistence: true, or remove fsync")
        return self


class RedisPassword(SpecModel):
    """Where the external server's password is, by reference (never in the spec): a file in the
    secrets folder, or an Airflow connection. Numaflow's Kubernetes secret selector is refused."""

    file: str | None = None
    """A file holding the password, in the secrets folder (relative: to the data dir)."""
    connectionId: str | None = None
    """An Airflow connection id whose password is the server's."""

    @model_validator(mode="after")
    def _one(self) -> RedisPassword:
        if (self.file is None) == (self.connectionId is None):
            raise ValueError("set one of file (a file in the secrets folder) or connectionId (an Airflow "
                             "connection)")
        return self


_REDIS_URL = re.compile(r"^(?:rediss?://)?(?:[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\])(?::(\d{1,5}))?(?:/\d{1,2})?\Z")


class RedisConfig(SpecModel):
    """``redis.external``: a Redis server isbflow connects to and starts nothing for. Numaflow's
    Sentinel fields (``sentinelUrl``, ``masterName``, ``sentinelPassword``) are refused."""

    url: str
    """``host:port`` (Numaflow's form), ``redis://host:port[/db]`` or ``rediss://...`` (TLS). No
    credentials in it: ``user`` and ``password``."""
    user: str | None = None
    """The user to log in as (an ACL user). Default: Redis's ``default``."""
    password: RedisPassword | None = None
    """Where the password is (a file or an Airflow connection). Default: none."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if "@" in v:
            raise ValueError("credentials do not go in the url: name the user with user and the password's "
                             "file or connection with password")
        m = _REDIS_URL.match(v)
        if m is None or (m.group(1) is not None and not 0 < int(m.group(1)) < 65536):
            raise ValueError(f"{v!r} is not a Redis address: use host:port, redis://host:port[/db] or "
                             "rediss://host:port[/db]")
        return v


class RedisService(SpecModel):
    """``redis``: the buffers in Redis Streams, one of ``native`` (isbflow starts redis-server) or
    ``external`` (a server at a URL)."""

    native: NativeRedis | None = None
    """A redis-server isbflow starts under the data dir (``native: {}`` for the defaults)."""
    external: RedisConfig | None = None
    """A Redis server elsewhere, by URL."""

    @field_validator("external")
    @classmethod
    def _not_both(cls, v: RedisConfig | None, info: ValidationInfo) -> RedisConfig | None:
        if v is not None and info.data.get("native") is not None:
            raise ValueError("native and external are both set: a service is one Redis server, started by "
                             "isbflow (native) or at a URL (external): remove one")
        return v

    @model_validator(mode="after")
    def _one(self) -> RedisService:
        if self.native is None and self.external is None:
            raise ValueError("set native (isbflow starts redis-server: 'native: {}' for the defaults) or "
                             "external (url: host:port)")
        return self


class InterStepBufferServiceSpec(SpecModel):
    redis: RedisService | None = None
    """The buffers in Redis Streams instead of JetStream (``native`` or ``external``); not with
    ``jetstream``. Default: none (JetStream)."""
    jetstream: JetStreamService = Field(default_factory=JetStreamService)
    """The JetStream service; not with ``redis``. Default: the embedded one with default settings."""

    @field_validator("jetstream")
    @classmethod
    def _one_store(cls, v: JetStreamService, info: ValidationInfo) -> JetStreamService:
        if info.data.get("redis") is not None:
            raise ValueError("jetstream and redis are both set: a service keeps its buffers in one store: "
                             "remove one")
        return v

    @property
    def store(self) -> Literal["jetstream", "redis"]:
        """Where the buffers live: ``redis`` when ``redis`` is set, else ``jetstream``."""
        return "redis" if self.redis is not None else "jetstream"


class InterStepBufferService(SpecModel):
    """The store a pipeline's buffers live on, JetStream or Redis (Numaflow's kind of the same name)."""

    apiVersion: str | None = None
    """``isbflow.io/v1alpha1``; any value is accepted (a Numaflow spec's too)."""
    kind: Literal["InterStepBufferService"]
    """``InterStepBufferService``."""
    metadata: Metadata = Field(default_factory=lambda: Metadata(name="default"))
    """The service's name (pipelines name it in ``interStepBufferServiceName``). Default ``default``."""
    spec: InterStepBufferServiceSpec = Field(default_factory=InterStepBufferServiceSpec)
    """The service. Default: the embedded JetStream one with default settings."""

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def store(self) -> Literal["jetstream", "redis"]:
        """``jetstream`` or ``redis`` (:attr:`InterStepBufferServiceSpec.store`)."""
        return self.spec.store
