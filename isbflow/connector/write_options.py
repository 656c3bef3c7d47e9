"""The writer's options, frame ids and per-batch report: what the driver and the executor tasks share.

See :mod:`isbflow.connector.writer` for the writer's contract and the option names.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import WriterCommitMessage

from isbflow.connector.options import DEFAULT_FRAME_ROWS, int_option
from isbflow.isb import naming
from isbflow.isb.connect import NatsSettings, resolve_settings, settings_from_json
from isbflow.isb.errors import ConnectorOptionError
from isbflow.spec.models import DEFAULT_LIMITS, OnFull

PARTITION_COLUMN = "_isb_partition"
#: A row with this column set is not published: it goes to the dead-letter buffer with
#: the column's text as its reason (the source step marks records it cannot parse).
ERROR_COLUMN = "_isb_error"
#: The raw record of a rejected row, kept for its dead letter; never published.
RAW_COLUMN = "_isb_raw"
BATCH_ID_PROPERTY = "streaming.sql.batchId"
DEFAULT_COMMITTED_KEY = "committed.{to}.{stream}"
DEFAULT_WINDOW = 32
#: seconds a frame answered 'no stream' (503) is sent again before the buffer counts as missing
#: (a cluster stream electing a new leader answers 503 for a few seconds)
UNAVAILABLE_FOR = 5.0


class InvalidPartitionColumn(ValueError):
    """A row's ``_isb_partition`` is null or outside the edge's partitions."""


class OutputBufferNotFound(Exception):
    """The stream of an output buffer does not exist (no stream answers its subject)."""

    def __init__(self, stream: str, subject: str):
        super().__init__(stream, subject)
        self.stream, self.subject = stream, subject

    def __str__(self) -> str:
        return (f"output buffer {self.stream} does not exist on the ISB service (nothing stores subject "
                f"{self.subject}): provision the pipeline ('isbflow isb apply') or check the writer options "
                "'pipeline', 'step', 'to' and 'partitions'")


class BufferWriteError(Exception):
    """Publishing a frame failed for a reason other than a full buffer (the message says which frame)."""



# ------------------------------------------------------------------ options


def _optional_int(options: Mapping[str, str], key: str) -> int | None:
    raw = options.get(key)
    return None if raw is None or str(raw).strip() == "" else int_option(options, key, 0)


def _required(options: Mapping[str, str], key: str, what: str) -> str:
    value = str(options.get(key) or "").strip()
    if not value:
        raise ConnectorOptionError(f"option '{key}' is required: {what}")
    return value


@dataclass(frozen=True)
class WriterOptions:
    """Typed writer options (module docstring lists them). Picklable: it travels to executors."""

    settings: NatsSettings
    pipeline: str
    step: str
    to: str
    partitions: int = 1
    max_payload: int | None = None
    frame_rows: int = DEFAULT_FRAME_ROWS
    buffer_max_length: int | None = None
    buffer_usage_limit: float = DEFAULT_LIMITS.bufferUsageLimit or 0.8
    on_full: OnFull = OnFull.RETRY_UNTIL_SUCCESS
    committed_key: str = DEFAULT_COMMITTED_KEY
    dlq_subject: str | None = None
    stats_dir: str | None = None
    window: int = DEFAULT_WINDOW

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriterOptions:
        raw_settings = options.get("settings")
        settings = settings_from_json(raw_settings) if raw_settings else resolve_settings()
        raw_limit = options.get("bufferUsageLimit")
        usage_limit = cls.buffer_usage_limit
        if raw_limit is not None and str(raw_limit).strip():
            try:
                usage_limit = float(raw_limit)
            except ValueError:
                usage_limit = -1.0
            if not 0 < usage_limit <= 1:
                raise ConnectorOptionError(f"option 'bufferUsageLimit': expected a fraction in (0, 1], "
                                           f"got {raw_limit!r}")
        raw_on_full = str(options.get("onFull") or OnFull.RETRY_UNTIL_SUCCESS.value).strip()
        try:
            on_full = OnFull(raw_on_full)
        except ValueError:
            raise ConnectorOptionError(
                f"option 'onFull': expected one of {', '.join(m.value for m in OnFull)}, got {raw_on_full!r}"
            ) from None
        committed_key = str(options.get("committedKey") or DEFAULT_COMMITTED_KEY)
        try:
            committed_key.format(to="t", stream="s")
        except (KeyError, IndexError, ValueError):
            raise ConnectorOptionError(
                f"option 'committedKey': a template with at most {{to}} and {{stream}}, got {committed_key!r}"
            ) from None
        return cls(
            settings=settings,
            pipeline=_required(options, "pipeline", "the pipeline name (names the buffers)"),
            step=_required(options, "step", "the writing vertex (names the buffers and frame ids)"),
            to=_required(options, "to", "the target vertex of the edge written"),
            partitions=int_option(options, "partitions", 1),
            max_payload=_optional_int(options, "maxPayload"),
            frame_rows=int_option(options, "frameRows", DEFAULT_FRAME_ROWS),
            buffer_max_length=_optional_int(options, "bufferMaxLength"),
            buffer_usage_limit=usage_limit,
            on_full=on_full,
            committed_key=committed_key,
            dlq_subject=str(options.get("dlqSubject") or "").strip() or None,
            stats_dir=str(options.get("statsDir") or "").strip() or None,
            window=int_option(options, "publishWindow", DEFAULT_WINDOW),
        )

    def buffer(self, partition: int) -> naming.EdgePartition:
        return naming.EdgePartition(self.pipeline, self.step, self.to, partition)

    @property
    def capacity_frames(self) -> int | None:
        """Frames a partition may hold uncommitted downstream; None = unbounded."""
        if self.buffer_max_length is None:
            return None
        return max(1, math.ceil(self.buffer_max_length * self.buffer_usage_limit / self.frame_rows))


# ------------------------------------------------------------------ task identity


def spark_task_identity() -> tuple[int, int]:
    """(micro-batch id, task partition id) of the running Spark task. Executor only."""
    from pyspark import TaskContext

    tc = TaskContext.get()
    if tc is None:
        raise RuntimeError("JetStreamStreamWriter.write runs inside a Spark task (no TaskContext here)")
    raw = tc.getLocalProperty(BATCH_ID_PROPERTY)
    if raw is None:
        raise RuntimeError(f"no Spark local property {BATCH_ID_PROPERTY!r}: the jetstream writer works in "
                           "streaming queries (writeStream) only")
    return int(raw), tc.partitionId()


def frame_id(step: str, batch_id: int, task: int, partition: int | str, chunk: int) -> str:
    """The ``Nats-Msg-Id`` of a frame: equal for equal inputs, so a re-executed batch deduplicates."""
    return f"{step}:{batch_id}:{task}:{partition}:{chunk}"


# ------------------------------------------------------------------ reports


_COUNTS = ("frames", "rows", "duplicate_frames", "duplicate_rows", "discarded_frames", "discarded_rows",
           "dead_lettered")


@dataclass
class JetStreamWriteReport(WriterCommitMessage):
    """What one task published. ``frames``/``rows`` count frames JetStream stored anew;
    duplicates (PubAck ``duplicate``), discarded (``onFull=discardLatest``) and
    dead-lettered rows are counted apart. ``partitions`` maps edge partition ->
    {count name: n}; ``blocked_seconds`` is time spent waiting on full buffers."""

    batch_id: int
    task: int
    partitions: dict[int, dict[str, int]] = field(default_factory=dict)
    blocked_seconds: float = 0.0

    def count(self, partition: int, name: str, n: int = 1) -> None:
        counts = self.partitions.setdefault(partition, dict.fromkeys(_COUNTS, 0))
        counts[name] += n

    def total(self, name: str) -> int:
        return sum(c[name] for c in self.partitions.values())


def aggregate_reports(messages: Iterable[JetStreamWriteReport | None], batch_id: int,
                      options: WriterOptions | None = None) -> dict[str, Any]:
    """The batch's counts, summed over tasks; ``partitions`` keyed by stream name when options are given."""
    out: dict[str, Any] = {"batchId": batch_id, "tasks": 0, "failedTasks": 0, "blockedSeconds": 0.0,
                           **dict.fromkeys(_COUNTS, 0), "partitions": {}}
    for m in messages:
        if m is None:
            out["failedTasks"] += 1
            continue
        out["tasks"] += 1
        out["blockedSeconds"] += m.blocked_seconds
        for p, counts in m.partitions.items():
            key = options.buffer(p).stream if options else str(p)
            agg = out["partitions"].setdefault(key, dict.fromkeys(_COUNTS, 0))
            for name, n in counts.items():
                agg[name] += n
                out[name] += n
    out["blockedSeconds"] = round(out["blockedSeconds"], 3)
    return out


def read_write_stats(stats_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The per-batch stats files written by :meth:`JetStreamStreamWriter.commit`, by batch id."""
    out = [json.loads(p.read_text()) for p in Path(stats_dir).glob("batch-*.json")]
    return sorted(out, key=lambda s: s["batchId"])


