"""The ``InterStepBufferService`` kind: the JetStream service the buffers live on.

Fields follow Numaflow's (``jetstream.url``, ``settings``, ``bufferConfig.stream``);
Numaflow's numeric ``retention``/``storage`` codes are read as Numaflow means them
and its fields isbflow has no use for are refused (:mod:`isbflow.spec.numaflow`).
"""

from __future__ import annotations

import re
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
from isbflow.spec.numaflow import RETENTION_CODES, STORAGE_CODES, numeric_code


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


class InterStepBufferServiceSpec(SpecModel):
    jetstream: JetStreamService = Field(default_factory=JetStreamService)
    """The JetStream service. Default: the embedded one with default settings."""


class InterStepBufferService(SpecModel):
    """The JetStream service a pipeline's buffers live on (Numaflow's kind of the same name)."""

    apiVersion: str | None = None
    """``isbflow.io/v1alpha1``; any value is accepted (a Numaflow spec's too)."""
    kind: Literal["InterStepBufferService"]
    """``InterStepBufferService``."""
    metadata: Metadata = Field(default_factory=lambda: Metadata(name="default"))
    """The service's name (pipelines name it in ``interStepBufferServiceName``). Default ``default``."""
    spec: InterStepBufferServiceSpec = Field(default_factory=InterStepBufferServiceSpec)
    """The service. Default: the embedded one with default settings."""

    @property
    def name(self) -> str:
        return self.metadata.name
