"""The ``foreachBatch`` writer of a sink vertex with ``sink.delta`` (:mod:`isbflow.sinks.delta_spark`).

Spark's executors write the Parquet, the driver commits each micro-batch once
through delta-rs. The modes: ``append`` (or the runner's ``sink_mode``:
``merge`` during recovery, on the runner's ``merge_keys`` for a sink without
``_isb_id``) and, for the sink of a ``udf.output: update`` step, ``upsert`` on
its keys with the latest version per key and batch (``merge`` during recovery:
insert the latest version of keys the table lacks). The app id is the runner's
(pipeline, vertex, checkpoint epoch), so a fresh checkpoint after a recovery is
not taken for batches the table already holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from isbflow.sinks.delta_files import DeltaSinkOptionError, DeltaSinkOptions
from isbflow.sinks.delta_spark import DeltaBatchWriter
from isbflow.spec.models import Vertex
from isbflow.steps.restart import StepError
from isbflow.steps.update import VERSION_COLUMN


def delta_options(runner, v: Vertex, mode: str, keys: Sequence[str] | None,
                  upsert: Sequence[str] | None) -> DeltaSinkOptions:
    """The validated options of sink ``v`` (path, app id, offset ledger, mode, keys, partitions)."""
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
    return DeltaSinkOptions.from_options(options)


def delta_writer(runner, v: Vertex, columns: Sequence[str], mode: str, keys: Sequence[str] | None,
                 upsert: Sequence[str] | None) -> DeltaBatchWriter:
    """The sink's ``foreachBatch`` function; checks now that the columns it names exist."""
    try:
        writer = DeltaBatchWriter(delta_options(runner, v, mode, keys, upsert))
        writer.check(list(columns))
    except DeltaSinkOptionError as e:
        raise StepError(f"step {v.name!r}: {e}") from None
    return writer
