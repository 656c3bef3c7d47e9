"""Check a pipeline's sinks: the spec's expectations (GX) plus the built-in checks, gated per sink.

Runs by itself after every drain, batch run and replay: it is scheduled on
the sinks as Airflow Assets (``isbflow://<pipeline>/<sink>``), and those tasks
emit an asset event per sink they wrote; such a run checks the sinks the
events name. It also runs hourly (a continuously running pipeline emits no
asset events), and triggered by hand; those runs check the chosen pipeline's sinks.

A sink whose gate is ``onFailure: fail`` and fails its checks fails the task;
a ``warn`` gate logs WARN with the failures and the task succeeds. The XCom
holds each sink's verdict, run id and report path (Data Docs page beside it).
Connection: ``nats_default`` (dead letters, for completeness).
"""

from __future__ import annotations

from airflow.sdk import DAG, AssetAny, AssetOrTimeSchedule, CronTriggerTimetable, Param

from isbflow.airflow.assets import sink_asset
from isbflow.airflow.catalog import load_catalog
from isbflow.airflow.operators.quality import PipelineQualityOperator
from isbflow.airflow.pipelines import pipeline_param, pipelines_dir

PIPELINES = pipelines_dir(__file__)
SINKS = [sink_asset(e.name, s) for e in load_catalog(PIPELINES).entries for s in e.sinks]

with DAG(
    dag_id="pipeline_quality",
    description="Run the quality checks of a pipeline's sinks; fail on a 'fail' gate, warn on a 'warn' gate",
    schedule=(AssetOrTimeSchedule(timetable=CronTriggerTimetable("@hourly", timezone="UTC"), assets=AssetAny(*SINKS))
              if SINKS else "@hourly"),
    catchup=False,
    max_active_runs=1,
    tags=["isbflow", "quality"],
    doc_md=__doc__,
    params={
        "pipeline": pipeline_param(PIPELINES),
        "sinks": Param([], type="array", items={"type": "string"}, title="Sinks",
                       description="Sink vertices to check (empty: every sink of the pipeline). "
                                   "Runs started by asset events check the sinks the events name."),
        "master": Param("local[2]", type="string", title="Spark master",
                        description="Where the checks' Spark session runs: local[N] or spark://host:7077."),
    },
) as dag:
    PipelineQualityOperator(task_id="quality", pipeline_file="{{ params.pipeline }}",
                            pipelines_dir=str(PIPELINES), sinks="{{ params.sinks }}",
                            master="{{ params.master }}")
