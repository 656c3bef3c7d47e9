"""The ``foreachBatch`` writer of a sink vertex with ``sink.postgres`` (:mod:`isbflow.sinks.postgres`).

The same modes as the Delta sink's: ``append`` (keyed on ``_isb_id``: a row whose
id the table holds is not inserted again), ``merge`` during recovery (the same,
on the runner's ``merge_keys`` for a sink without ``_isb_id``) and ``upsert``
for the sink of a ``udf.output: update`` step (its keys, the latest version per
key and batch). The app id is the runner's (pipeline, vertex, checkpoint epoch),
so a fresh checkpoint after a recovery is not taken for batches already held.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from isbflow.isb.ledger import ID_COLUMN
from isbflow.sinks.postgres import (
    PostgresBatchWriter,
    PostgresSinkError,
    PostgresTarget,
)
from isbflow.spec.models import Vertex
from isbflow.steps.restart import StepError
from isbflow.steps.update import VERSION_COLUMN

log = logging.getLogger(__name__)


def postgres_target(runner, v: Vertex, mode: str, keys: Sequence[str] | None,
                    upsert: Sequence[str] | None) -> PostgresTarget:
    """The driver-side settings of sink ``v`` (never a password: resolved when it connects)."""
    assert v.sink is not None and v.sink.postgres is not None
    if upsert:
        mode = "merge" if mode == "merge" else "upsert"
        keys = keys or upsert
    return PostgresTarget(sink=v.name, spec=v.sink.postgres, app_id=runner.sink_app_id(v.name), mode=mode,
                          key=tuple(keys or (ID_COLUMN,)), version_column=VERSION_COLUMN if upsert else None,
                          data_dir=str(runner.data_dir), pipeline=runner.p.name,
                          ledger_settings=runner.settings_json)


def fallback_target(runner, v: Vertex) -> PostgresTarget:
    """The settings of sink ``v``'s PostgreSQL fallback table: the primary's app id, keyed on ``_isb_id``,
    append only (:class:`isbflow.sinks.fallback.PostgresFallback`)."""
    assert v.sink is not None and v.sink.fallback is not None and v.sink.fallback.postgres is not None
    return PostgresTarget(sink=v.name, spec=v.sink.fallback.postgres, app_id=runner.sink_app_id(v.name),
                          data_dir=str(runner.data_dir), pipeline=runner.p.name)


def postgres_writer(runner, v: Vertex, columns: Sequence[str], mode: str, keys: Sequence[str] | None,
                    upsert: Sequence[str] | None) -> PostgresBatchWriter:
    """The sink's ``foreachBatch`` function; checks now that the server answers (a clear
    :class:`StepError` naming the sink and its connection, never the password)."""
    writer = PostgresBatchWriter(postgres_target(runner, v, mode, keys, upsert))
    try:
        writer.check(columns)
    except PostgresSinkError as e:
        if v.sink.retryStrategy is None or "cannot connect" not in str(e):
            raise StepError(f"step {v.name!r}: {e}") from None
        # the sink's retryStrategy owns a server that is down: its batches are retried (or fall back)
        log.warning("step %s: %s; its batches follow the sink's retryStrategy", v.name, e)
    return writer
