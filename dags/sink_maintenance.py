"""Keep every pipeline's sink tables small on a long run: compaction, vacuum, a bounded log, daily.

One ``maintain_<pipeline>`` task per pipeline under the pipelines folder (from
the catalog). Each compacts its sinks' small files into large ones in one
OPTIMIZE commit per table (rows, offset ledger and ``quality verify`` unchanged),
then vacuums data files the log removed more than ``retention_hours`` ago
(default and floor 168 h = 7 days; lower only with ``force``), then bounds the
table's log: the offsets its commits recorded are folded into one kept commit,
a checkpoint is written and log entries older than ``log_retention_hours`` are
removed (default and floor 168 h, the vacuum's). Safe beside a
running stream: Delta's optimistic concurrency lets the stream's appends and the
compaction commit around each other, and vacuum never touches files a batch has
written but not yet committed. Needs no NATS connection. ``dry_run`` changes
nothing and reports what vacuum would delete.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param

from isbflow.airflow.catalog import load_catalog, task_id_for
from isbflow.airflow.operators.sinks import SinkMaintenanceOperator
from isbflow.airflow.pipelines import pipelines_dir

PIPELINES = pipelines_dir(__file__)
CATALOG = load_catalog(PIPELINES)

with DAG(
    dag_id="sink_maintenance",
    description="Daily: compact each pipeline's sink tables, vacuum files removed longer ago than the retention, "
                "bound their logs",
    schedule="@daily",
    catchup=False,
    max_active_runs=1,
    tags=["isbflow", "maintenance"],
    doc_md=__doc__,
    params={
        "retention_hours": Param(168, type="integer", minimum=0, title="Vacuum retention (hours)",
                                 description="Vacuum deletes data files the table's log removed more than this "
                                             "many hours ago. Below 168 (7 days) only with force."),
        "log_retention_hours": Param(168, type="number", minimum=0, title="Log retention (hours)",
                                     description="Delta log entries older than this many hours are removed, "
                                                 "after their offsets are folded into one kept commit. Below "
                                                 "168 only with force."),
        "force": Param(False, type="boolean", title="Force",
                       description="Allow a retention below the 168 h floor (readers on older snapshots, "
                                   "time travel and verify of old reprocess commits may then fail)."),
        "dry_run": Param(False, type="boolean", title="Dry run",
                         description="Change nothing: count files and list what vacuum would delete."),
    },
) as dag:
    for entry in CATALOG.entries:
        SinkMaintenanceOperator(
            task_id=task_id_for(f"maintain_{entry.name}"), pipeline_file=entry.file, pipelines_dir=str(PIPELINES),
            pipeline=entry.name, retention_hours="{{ params.retention_hours }}",
            log_retention_hours="{{ params.log_retention_hours }}", force="{{ params.force }}",
            dry_run="{{ params.dry_run }}")
