"""The writer's options, frame ids, per-batch report and stats files: what the driver and the executor tasks share.

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

from pyspark import TaskContext
from pyspark.sql.datasource import WriterCommitMessage

from isbflow.connector.options import DEFAULT_FRAME_ROWS, int_option
from isbflow.isb import naming
from isbflow.isb.errors import ConnectorOptionError
from isbflow.isb.settings import NatsSettings, resolve_settings, settings_from_json
from isbflow.spec import constants
from isbflow.spec.constants import OnFull
from isbflow.spec.paths import private_dir

PARTITION_COLUMN = "_isb_partition"
#: A row with this column set is not published: it goes to the dead-letter buffer with
#: the column's text as its reason (the source step marks records it cannot parse).
ERROR_COLUMN = "_isb_error"
#: The raw record of a rejected row, kept for its dead letter; never published.
RAW_COLUMN = "_isb_raw"
#: A row with this column true matched no out edge's conditions (:mod:`isbflow.steps.routing`):
#: never published, counted as ``unrouted`` (and dead-lettered when ``_isb_error`` is set too).
UNROUTED_COLUMN = "_isb_unrouted"
#: Option of a fan-out writer: JSON list of the out edges one query writes (``targets``, module
#: docstring of :mod:`isbflow.connector.writer`); each row then says per edge ``i`` which partition
#: takes it in ``_isb_partition_<i>`` (null: edge ``i`` does not take the row).
TARGETS_OPTION = "targets"
#: Per-edge options a ``targets`` entry may set; the rest are the writer's, shared by every edge.
TARGET_KEYS = ("to", "partitions", "bufferMaxLength", "bufferUsageLimit", "statsDir", "committedKey", "routedSinks")


def target_column(i: int) -> str:
    """The partition column of out edge ``i`` of a fan-out writer."""
    return f"{PARTITION_COLUMN}_{i}"


def partition_columns(names: Iterable[str]) -> list[str]:
    """The routing columns among ``names`` (``_isb_partition`` and ``_isb_partition_<i>``)."""
    return [n for n in names if n == PARTITION_COLUMN or n.startswith(PARTITION_COLUMN + "_")]
BATCH_ID_PROPERTY = "streaming.sql.batchId"
DEFAULT_COMMITTED_KEY = "committed.{to}.{stream}"
DEFAULT_WINDOW = 32
#: per-batch stats files a stats dir keeps (the newest); older ones are summed into the totals' ``pruned``
DEFAULT_STATS_KEEP = 100
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
    buffer_usage_limit: float = constants.BUFFER_USAGE_LIMIT / 100
    on_full: OnFull = OnFull.RETRY_UNTIL_SUCCESS
    committed_key: str = DEFAULT_COMMITTED_KEY
    dlq_subject: str | None = None
    stats_dir: str | None = None
    stats_keep: int = DEFAULT_STATS_KEEP
    window: int = DEFAULT_WINDOW
    #: sinks this edge gates (:mod:`isbflow.isb.routed`): the ids of rows it does not take are recorded
    routed_sinks: tuple[str, ...] = ()

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
            stats_keep=int_option(options, "statsKeep", DEFAULT_STATS_KEEP),
            window=int_option(options, "publishWindow", DEFAULT_WINDOW),
            routed_sinks=tuple(x.strip() for x in str(options.get("routedSinks") or "").split(",") if x.strip()),
        )

    @classmethod
    def parse_targets(cls, options: Mapping[str, str]) -> list[WriterOptions]:
        """The options of every edge written: one without a ``targets`` option, else one per entry
        (its keys over the shared options; only :data:`TARGET_KEYS` may differ per edge)."""
        raw = options.get(TARGETS_OPTION)
        if raw is None or not str(raw).strip():
            return [cls.parse(options)]
        try:
            targets = json.loads(raw)
        except ValueError as e:
            raise ConnectorOptionError(f"option '{TARGETS_OPTION}': not JSON ({e})") from None
        if not isinstance(targets, list) or not targets or not all(isinstance(t, dict) for t in targets):
            raise ConnectorOptionError(f"option '{TARGETS_OPTION}': expected a non-empty JSON list of objects "
                                       f"with keys among {', '.join(TARGET_KEYS)}, got {raw!r}")
        shared = {k: v for k, v in options.items() if k != TARGETS_OPTION}
        out = []
        for i, t in enumerate(targets):
            extra = sorted(set(t) - set(TARGET_KEYS))
            if extra:
                raise ConnectorOptionError(f"option '{TARGETS_OPTION}'[{i}]: unknown key(s) {', '.join(extra)} "
                                           f"(per edge: {', '.join(TARGET_KEYS)})")
            out.append(cls.parse({**shared, **{k: str(v) for k, v in t.items() if v is not None}}))
        tos = [o.to for o in out]
        if len(set(tos)) != len(tos):
            raise ConnectorOptionError(f"option '{TARGETS_OPTION}': an edge is named twice ({', '.join(tos)})")
        return out

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
    tc = TaskContext.get()
    if tc is None:
        raise RuntimeError("JetStreamStreamWriter.write runs inside a Spark task (no TaskContext here)")
    raw = tc.getLocalProperty(BATCH_ID_PROPERTY)
    if raw is None:
        raise RuntimeError(f"no Spark local property {BATCH_ID_PROPERTY!r}: the jetstream writer works in "
                           "streaming queries (writeStream) only")
    return int(raw), tc.partitionId()


# ------------------------------------------------------------------ reports


_COUNTS = ("frames", "rows", "duplicate_frames", "duplicate_rows", "discarded_frames", "discarded_rows",
           "dead_lettered", "unrouted")


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
    #: source partition -> ranges of ``_isb_id`` the edge did not take (``routedSinks`` only)
    routed: dict[str, list[list[int]]] = field(default_factory=dict)

    def count(self, partition: int, name: str, n: int = 1) -> None:
        counts = self.partitions.setdefault(partition, dict.fromkeys(_COUNTS, 0))
        counts[name] += n

    def total(self, name: str) -> int:
        return sum(c[name] for c in self.partitions.values())


@dataclass
class FanOutReport(WriterCommitMessage):
    """What one task of a fan-out writer published: one report per out edge, in ``targets`` order
    (dead letters and unrouted rows, counted once per row, are in the first edge's)."""

    reports: list[JetStreamWriteReport]


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


TOTALS_FILE = "totals.json"
_SUMMED = ("tasks", "failedTasks", *_COUNTS)


def _batch_file(stats_dir: Path, batch_id: int) -> Path:
    return stats_dir / f"batch-{batch_id}.json"


def _batch_files(stats_dir: Path) -> dict[int, Path]:
    out = {}
    for p in stats_dir.glob("batch-*.json"):
        try:
            out[int(p.stem.removeprefix("batch-"))] = p
        except ValueError:
            continue
    return out


def _empty_sum() -> dict[str, Any]:
    return {"batches": 0, "firstBatchId": None, "lastBatchId": None, "blockedSeconds": 0.0,
            **dict.fromkeys(_SUMMED, 0), "partitions": {}}


def _add(total: dict[str, Any], stats: Mapping[str, Any]) -> None:
    """Add one batch's stats (or a sum of batches) to ``total``, in place."""
    total["batches"] += int(stats.get("batches", 1))
    first = stats.get("firstBatchId", stats.get("batchId"))
    last = stats.get("lastBatchId", stats.get("batchId"))
    if first is not None:
        total["firstBatchId"] = first if total["firstBatchId"] is None else min(total["firstBatchId"], first)
    if last is not None:
        total["lastBatchId"] = last if total["lastBatchId"] is None else max(total["lastBatchId"], last)
    total["blockedSeconds"] = round(total["blockedSeconds"] + float(stats.get("blockedSeconds") or 0.0), 3)
    for name in _SUMMED:  # .get: totals written before a count existed lack it
        total[name] = total.get(name, 0) + int(stats.get(name) or 0)
    for key, counts in (stats.get("partitions") or {}).items():
        agg = total["partitions"].setdefault(key, dict.fromkeys(_COUNTS, 0))
        for name, n in counts.items():
            agg[name] = agg.get(name, 0) + int(n or 0)


def _write_json(path: Path, value: Any) -> None:
    """Write atomically: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)


def _read_json(path: Path) -> Any:
    """A stats file's content; None when it is gone (pruned, or its dir moved aside, meanwhile)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _load_totals(stats_dir: Path) -> dict[str, Any] | None:
    return _read_json(stats_dir / TOTALS_FILE)


def _sum_files(stats_dir: Path) -> dict[str, Any]:
    """Totals summed from the per-batch files: a dir written before ``totals.json`` existed."""
    totals = {**_empty_sum(), "pruned": _empty_sum()}
    for _, p in sorted(_batch_files(stats_dir).items()):
        stats = _read_json(p)
        if stats is not None:
            _add(totals, stats)
    return totals


def record_write_stats(stats_dir: str | os.PathLike, stats: Mapping[str, Any],
                       keep: int = DEFAULT_STATS_KEEP) -> bool:
    """Driver, once per committed micro-batch: keep ``stats`` (an :func:`aggregate_reports` result).

    Writes ``batch-<batchId>.json``, adds the batch to the running ``totals.json`` and prunes the
    per-batch files but the newest ``keep`` (their counts move into the totals' ``pruned`` sum), so
    a stats dir holds at most ``keep + 1`` files however long the query runs. Every file is
    replaced atomically (write, then rename). A batch id the totals already include (Spark commits
    the last batch again after a restart) is not counted twice: its stats are logged by the
    caller, the files stay as they are, and False is returned. Batch ids of one stats dir only
    grow: a recovery moves the dir aside together with the query's checkpoint.
    """
    d = private_dir(stats_dir)
    batch_id = int(stats["batchId"])
    totals = _load_totals(d)
    if totals is None:  # a new dir, or one written before totals existed: sum what it holds, once
        totals = _sum_files(d)
    elif totals["lastBatchId"] is not None and batch_id <= totals["lastBatchId"]:
        return False
    _write_json(_batch_file(d, batch_id), dict(stats))
    _add(totals, stats)
    files = _batch_files(d)
    old = sorted(files)[:-keep] if keep > 0 else sorted(files)
    pruned_last = totals["pruned"]["lastBatchId"]
    for b in old:
        if pruned_last is None or b > pruned_last:  # not yet in the pruned sum (a crash may leave one)
            _add(totals["pruned"], _read_json(files[b]) or {"batchId": b, "batches": 0})
    _write_json(d / TOTALS_FILE, totals)
    for b in old:
        files[b].unlink(missing_ok=True)
    return True


def read_write_totals(stats_dir: str | os.PathLike) -> dict[str, Any]:
    """The running totals of a stats dir (:func:`record_write_stats`): every count summed over
    every batch committed so far, with ``batches``, ``firstBatchId`` and ``lastBatchId``.
    Reads one small file however many batches ran; zeros for a dir with no commit yet."""
    d = Path(stats_dir)
    totals = _load_totals(d)
    return totals if totals is not None else _sum_files(d)


def read_write_stats(stats_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The per-batch stats written by :meth:`JetStreamStreamWriter.commit`, by batch id.

    Only the newest batches keep a file (:func:`record_write_stats`); when older ones were
    pruned, the list starts with one entry summing them (``"pruned": True``, ``batchId`` = the
    last pruned batch, ``firstBatchId``, ``batches``), so sums over the list are sums over every
    batch. For totals alone, :func:`read_write_totals` reads one file.
    """
    d = Path(stats_dir)
    files = {b: s for b, p in sorted(_batch_files(d).items()) if (s := _read_json(p)) is not None}
    # the totals after the files: a file pruned meanwhile is in their pruned sum (and skipped below)
    pruned = (_load_totals(d) or {}).get("pruned") or {}
    last = pruned.get("lastBatchId")
    out = [s for b, s in files.items() if last is None or b > last]
    if pruned.get("batches"):
        out.insert(0, {**pruned, "batchId": last, "pruned": True})
    return out
