"""The ``foreachBatch`` writer of a sink vertex with ``sink.delta``.

Written through (:mod:`isbflow.steps.write_through`, the default): the read tasks write the
Parquet with pyarrow from the frames they decoded, the driver commits each micro-batch once
through delta-rs (:mod:`isbflow.sinks.delta_through`). A sink under a failure policy
(``retryStrategy``, ``fallback``), which hands a failed batch's rows on, keeps Spark's own
Parquet writer (:mod:`isbflow.sinks.delta_spark`): its batch holds the rows themselves. The
modes: ``append`` (or the runner's ``sink_mode``: ``merge`` during recovery, on the runner's
``merge_keys`` for a sink without ``_isb_id``) and, for the sink of a ``udf.output: update``
step, ``upsert`` on its keys with the latest version per key and batch (``merge`` during
recovery: insert the latest version of keys the table lacks). The app id is the runner's
(pipeline, vertex, checkpoint epoch), so a fresh checkpoint after a recovery is not taken for
batches the table already holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from isbflow.sinks.delta_files import DeltaSinkOptionError, DeltaSinkOptions
from isbflow.sinks.delta_spark import DeltaBatchWriter
from isbflow.sinks.delta_through import DeltaThroughWriter
from isbflow.spec.models import Vertex
from isbflow.steps.restart import StepError
from isbflow.steps.update import VERSION_COLUMN


def delta_option_map(runner, v: Vertex, mode: str, keys: Sequence[str] | None,
                     upsert: Sequence[str] | None) -> dict[str, str]:
    """Sink ``v``'s options as strings (path, app id, offset ledger, mode, keys, partitions)."""
    assert v.sink is not None and v.sink.delta is not None
    options = {"path": runner.sink_path(v), "appId": runner.sink_app_id(v.name), "pipeline": runner.p.name,
               "sink": v.name, "settings": runner.settings_json}
    if upsert:
        mode = "merge" if mode == "merge" else "upsert"
        keys = keys or upsert
        options["versionColumn"] = VERSION_COLUMN
    options["mode"] = mode
    if keys:
        options["mergeKey"] = ",".join(keys)
    if v.sink.delta.partitionBy:
        options["partitionBy"] = ",".join(v.sink.delta.partitionBy)
    return options


def writes_through(v: Vertex) -> bool:
    """Whether sink vertex ``v`` is written through (module docstring)."""
    return (v.sink is not None and v.sink.delta is not None and v.source is None and v.udf is None
            and v.sink.retryStrategy is None and v.sink.fallback is None)


def delta_writer(options: dict[str, str], columns: Sequence[str], vertex: str,
                 through: bool = False) -> DeltaBatchWriter:
    """The sink's ``foreachBatch`` function; checks now that the columns it names exist."""
    try:
        writer = (DeltaThroughWriter if through else DeltaBatchWriter)(DeltaSinkOptions.from_options(options))
        writer.check(list(columns))
    except DeltaSinkOptionError as e:
        raise StepError(f"step {vertex!r}: {e}") from None
    return writer
