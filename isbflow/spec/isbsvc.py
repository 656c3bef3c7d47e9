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
    LIMITS = "Limits"
    INTEREST = "Interest"
    WORK_QUEUE = "WorkQueue"


class Storage(StrEnum):
    FILE = "file"
    MEMORY = "memory"


class StreamConfig(SpecModel):
    """``bufferConfig.stream``: how each edge-partition stream is configured.

    ``retention`` and ``storage`` also take Numaflow's codes (0 Limits, 1 Interest,
    2 WorkQueue; 0 file, 1 memory)."""

    retention: Annotated[Retention, BeforeValidator(numeric_code(RETENTION_CODES, "retention"))] = Retention.LIMITS
    maxMsgs: StrictInt = Field(default=-1, ge=-1)
    maxAge: Duration = 72 * 3600.0
    maxBytes: Size = -1
    storage: Annotated[Storage, BeforeValidator(numeric_code(STORAGE_CODES, "storage"))] = Storage.FILE
    replicas: StrictInt = Field(default=1, ge=1, le=5)
    duplicates: Duration = 120.0


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
    maxAge: Duration = 7 * 24 * 3600.0
    maxBytes: Size = 256 * 1024**2
    replicas: StrictInt | None = Field(default=None, ge=1, le=5)


class BufferConfig(SpecModel):
    """``bufferConfig``: the buffers' stream settings (``stream``) and the dead-letter stream's
    (``deadLetter``, :class:`DeadLetterConfig`). Numaflow's ``consumer``, ``otBucket``
    and ``procBucket`` are refused (:data:`isbflow.spec.numaflow.FIELDS` says why)."""

    stream: StreamConfig = Field(default_factory=StreamConfig)
    deadLetter: DeadLetterConfig = Field(default_factory=DeadLetterConfig)

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
    max_memory_store: Size = 1024**3
    max_file_store: Size = 10 * 1024**3


class TLSConfig(SpecModel):
    caFile: str | None = None
    certFile: str | None = None
    keyFile: str | None = None
    insecureSkipVerify: bool = False


class AuthConfig(SpecModel):
    """Credentials by reference only: an Airflow connection id, a creds file, or a
    file holding ``user:password`` / a token. Secrets never sit in a spec."""

    connectionId: str | None = None
    credsFile: str | None = None
    userPasswordFile: str | None = None
    tokenFile: str | None = None


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
    replicas: StrictInt | None = Field(default=None, ge=1, le=5)
    persistence: Annotated[bool, BeforeValidator(_persistence)] = True
    settings: JetStreamSettings = Field(default_factory=JetStreamSettings)
    bufferConfig: BufferConfig = Field(default_factory=BufferConfig)
    tls: Annotated[TLSConfig | None, BeforeValidator(_tls)] = None
    auth: AuthConfig | None = None

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


class InterStepBufferService(SpecModel):
    apiVersion: str | None = None
    kind: Literal["InterStepBufferService"]
    metadata: Metadata = Field(default_factory=lambda: Metadata(name="default"))
    spec: InterStepBufferServiceSpec = Field(default_factory=InterStepBufferServiceSpec)

    @property
    def name(self) -> str:
        return self.metadata.name
