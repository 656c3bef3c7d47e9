"""``SinkMaintenanceOperator``: compact, vacuum and bound the logs of a pipeline's sink tables
(``ops.sinks.maintain_sinks``).

Needs no ISB service: it works on the Delta tables alone, beside a running
stream (see :mod:`isbflow.sinks.maintain` for why that is safe). A retention
below the floor without ``force``, or an unknown sink, fails the task without
retries; a table that could not be maintained (a commit conflict with a
concurrent rewrite) fails it with retries. XCom ``return_value``: per sink the
versions before and after, the file and log file counts and how many files vacuum deleted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from isbflow.airflow.operators.pipeline import PipelineOperatorBase, resolve_target
from isbflow.airflow.operators.quality import sink_list


class SinkMaintenanceOperator(PipelineOperatorBase):
    """Compact, vacuum, then bound the log of each sink table of a pipeline (module docstring).

    :param sinks: sink vertices (list or comma string; default all).
    :param retention_hours: vacuum deletes files the log removed more than this many hours ago
        (default and floor: ``isbflow.sinks.maintain.DEFAULT_RETENTION_HOURS``, 168).
    :param log_retention_hours: log entries older than this many hours are removed, after a fold
        keeps what the ledger and verify read from them (default and floor 168, the vacuum's).
    :param force: allow a retention below the floor.
    :param dry_run: change nothing; report what vacuum would delete.
    """

    template_fields: Sequence[str] = (*PipelineOperatorBase.template_fields, "sinks", "retention_hours",
                                      "log_retention_hours", "force", "dry_run")
    ui_color = "#e0e0f0"

    def __init__(self, *, sinks: list[str] | str | None = None, retention_hours: int | str | None = None,
                 log_retention_hours: float | str | None = None, force: bool | str = False,
                 dry_run: bool | str = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sinks = sinks
        self.retention_hours = retention_hours
        self.log_retention_hours = log_retention_hours
        self.force = force
        self.dry_run = dry_run

    def execute(self, context: Any) -> dict[str, Any]:
        # lazy: ops.sinks loads pyspark and deltalake (~1.1-2.3 s); DAG parsing must not (it reruns every 30 s)
        from isbflow.ops.sinks import (
            DEFAULT_LOG_RETENTION_HOURS,
            DEFAULT_RETENTION_HOURS,
            MaintenanceError,
            check_retention,
            maintain_sinks,
        )

        t = resolve_target(self.pipeline_file, self.pipelines_dir, self.pipeline or None, self.nats_conn_id,
                           self.data_dir or None, with_settings=False)
        hours = DEFAULT_RETENTION_HOURS if self.retention_hours in (None, "", "None") else int(self.retention_hours)
        log_hours = (DEFAULT_LOG_RETENTION_HOURS if self.log_retention_hours in (None, "", "None")
                     else float(self.log_retention_hours))
        force, dry_run = _flag(self.force), _flag(self.dry_run)
        sinks = sink_list(self.sinks)
        try:
            check_retention(hours, force, log_hours)
            known = [v.name for v in t.pipeline.spec.vertices if v.sink is not None]
            unknown = [s for s in sinks or [] if s not in known]
            if unknown:
                raise MaintenanceError(f"pipeline {t.pipeline.name!r} has no sink {', '.join(unknown)} "
                                       f"(sinks: {', '.join(known)})")
        except MaintenanceError as e:
            raise AirflowFailException(str(e)) from None
        results = maintain_sinks(t.pipeline, t.data_dir, sinks, retention_hours=hours, dry_run=dry_run, force=force,
                                 log_retention_hours=log_hours)
        for s, r in results.items():
            self.log.info("%s/%s: %s", t.pipeline.name, s, r.skipped or
                          f"v{r.version_before} -> v{r.version_after}, files {r.files_before} -> {r.files_after}, "
                          f"{len(r.vacuumed)} file(s) vacuumed (retention {r.retention_hours} h), log files "
                          f"{r.log_files_before} -> {r.log_files_after} (retention {r.log_retention_hours:g} h"
                          f"{', dry run' if dry_run else ''})")
        return {s: r.to_json() for s, r in results.items()}


def _flag(value: bool | str) -> bool:
    """A templated boolean: ``True``/``"true"``/``"True"``."""
    return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1", "yes")
