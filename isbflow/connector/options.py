"""Options of ``format("jetstream")``, parsed and checked once, and NatsSettings as an option.

Spark passes every option as a string. :class:`ReaderOptions` turns them into
typed values (or :class:`~isbflow.isb.errors.ConnectorOptionError` naming
the option); readers and writers never look at the raw mapping again.

Connection settings travel as the ``settings`` option, the JSON of
:class:`isbflow.isb.settings.NatsSettings` (:func:`isbflow.isb.settings.settings_to_json` /
:func:`~isbflow.isb.settings.settings_from_json`). Without it the settings are resolved where the
source is created (``NATS_URL``, or the embedded server's state file, see
:func:`isbflow.isb.connect.resolve_settings`). The JSON holds any password or
token in clear: Spark redacts option *keys* matching
``spark.redaction.regex`` (``secret|password|token``…), which ``settings`` is
not, so prefer a creds file or token file path over inline secrets on shared
clusters.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from isbflow.isb.errors import ConnectorOptionError
from isbflow.isb.settings import NatsSettings, resolve_settings, settings_from_json
from isbflow.spec import constants

Mode = Literal["frames", "events"]
OnLoss = Literal["fail", "replay"]

DEFAULT_FRAME_ROWS = 10_000
#: Messages per Spark task (input partition) unless ``maxMessagesPerPartition`` says otherwise.
DEFAULT_PARTITION_MSGS: dict[str, int] = {"frames": 100, "events": 50_000}
#: The fewest messages a task gets when a batch is split further for ``minPartitions``: a batch
#: smaller than this many per task slot stays in as few tasks as ``maxMessagesPerPartition`` gives
#: (a task costs a Python worker's turn and Spark's scheduling: the demo's micro-batches of a few
#: frames or a few hundred events stay one task each).
MIN_SPLIT_MSGS: dict[str, int] = {"frames": 4, "events": 5_000}


def int_option(options: Mapping[str, str], key: str, default: int, minimum: int = 1) -> int:
    raw = options.get(key)
    if raw is None or str(raw).strip() == "":
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ConnectorOptionError(f"option '{key}': expected an integer, got {raw!r}") from None
    if value < minimum:
        raise ConnectorOptionError(f"option '{key}': must be >= {minimum}, got {value}")
    return value


def _choice(options: Mapping[str, str], key: str, allowed: tuple[str, ...], default: str) -> str:
    raw = str(options.get(key) or default).strip().lower()
    if raw not in allowed:
        raise ConnectorOptionError(f"option '{key}': expected one of {', '.join(allowed)}, got {raw!r}")
    return raw


def _offsets_option(options: Mapping[str, str], key: str, words: tuple[str, ...]) -> str | dict | None:
    raw = options.get(key)
    if raw is None or str(raw).strip() == "":
        return None
    text = str(raw).strip()
    if text.lower() in words:
        return text.lower()
    try:
        d = json.loads(text)
        if not isinstance(d, dict) or not all(isinstance(v, dict) and "seq" in v for v in d.values()):
            raise ValueError("expected {\"<stream>\": {\"inc\": ..., \"seq\": N}, ...}")
        return d
    except ValueError as e:
        raise ConnectorOptionError(
            f"option '{key}': expected {' or '.join(repr(w) for w in words)} or offsets JSON ({e})"
        ) from None


def _seconds(options: Mapping[str, str], key: str) -> float:
    raw = str(options.get(key) or "0").strip()
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:
        raise ConnectorOptionError(f"option '{key}': expected seconds between 0 and 3600, got {raw!r}")
    return value


@dataclass(frozen=True)
class ReaderOptions:
    """Typed reader options; see :mod:`isbflow.connector.reader` for their meaning."""

    streams: tuple[str, ...]
    mode: Mode
    settings: NatsSettings
    read_max_rows: int
    frame_rows: int
    source_name: str
    on_buffer_loss: OnLoss
    #: "earliest" | "latest" | offsets JSON (dict) | None (= earliest)
    starting_offsets: str | dict | None
    #: batch reads only: "latest" | offsets JSON | None (= latest)
    ending_offsets: str | dict | None
    partition_msgs: int
    #: a batch's range is read by at least this many tasks when it holds at least
    #: :data:`MIN_SPLIT_MSGS` messages for each (Kafka's ``minPartitions``; the runner sets the task
    #: slots for a written-through sink)
    min_partitions: int = 1
    #: drain: with both set, latestOffset never passes the drain point the runner
    #: froze in the pipeline's status KV (``drain.<vertex>``; see isbflow.isb.state)
    drain_pipeline: str | None = None
    drain_vertex: str | None = None
    #: seconds a trigger that finds nothing new waits for its streams to grow (0: it does not
    #: wait); never under availableNow or while draining (isbflow.isb.wait)
    idle_wait: float = 0.0
    #: a file whose presence means "do not wait" (the runner creates it before stopping a step)
    no_wait_file: str | None = None
    #: a file holding the step's replicas now (its autoscaler writes it): a batch is read by at least
    #: that many tasks, as ``min_partitions`` (isbflow.steps.autoscale_apply)
    replicas_file: str | None = None

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReaderOptions:
        streams = tuple(s.strip() for s in str(options.get("streams") or "").split(",") if s.strip())
        if not streams:
            raise ConnectorOptionError("option 'streams' is required: a comma-separated list of "
                                       "stream names (the buffers to read)")
        if len(set(streams)) != len(streams):
            raise ConnectorOptionError(f"option 'streams' names a stream twice: {','.join(streams)}")
        mode = _choice(options, "mode", ("frames", "events"), "frames")
        source_name = str(options.get("sourceName") or "").strip()
        if mode == "events" and not source_name:
            raise ConnectorOptionError("option 'sourceName' is required with mode=events: it "
                                       "prefixes every record's _isb_id (<sourceName>/<partition>/<seq>)")
        raw_settings = options.get("settings")
        settings = settings_from_json(raw_settings) if raw_settings else resolve_settings()
        return cls(
            streams=streams,
            mode=mode,  # type: ignore[arg-type]
            settings=settings,
            read_max_rows=int_option(options, "readMaxRows", constants.READ_BATCH_SIZE),
            frame_rows=int_option(options, "frameRows", DEFAULT_FRAME_ROWS),
            source_name=source_name,
            on_buffer_loss=_choice(options, "onBufferLoss", ("fail", "replay"), "fail"),  # type: ignore[arg-type]
            starting_offsets=_offsets_option(options, "startingOffsets", ("earliest", "latest")),
            ending_offsets=_offsets_option(options, "endingOffsets", ("latest",)),
            partition_msgs=int_option(options, "maxMessagesPerPartition", DEFAULT_PARTITION_MSGS[mode]),
            min_partitions=int_option(options, "minPartitions", 1),
            drain_pipeline=(options.get("pipeline") or None),
            drain_vertex=(options.get("vertex") or None),
            idle_wait=_seconds(options, "idleWait"),
            no_wait_file=(str(options.get("noWaitFile") or "").strip() or None),
            replicas_file=(str(options.get("replicasFile") or "").strip() or None),
        )

    def max_messages(self, max_rows: int) -> int:
        """A row limit as a message limit: one event per message, ``frameRows`` rows per frame."""
        if self.mode == "events":
            return max_rows
        return max(1, math.ceil(max_rows / self.frame_rows))
