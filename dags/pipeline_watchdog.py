"""Watch every pipeline each minute: stalled steps, growing lag, buffer loss.

One ``watch_<pipeline>`` task per pipeline under the pipelines folder. A
pipeline with no running step is idle and passes. For a running one the task
fails, listing what it saw (the step and its heartbeat's age, the lag trend,
the lost stream and range), unless the spec says ``autoRecover: true``: then
the task ``recover_<pipeline>`` after it triggers ``pipeline_replay`` in
recover mode (skipped while the pipeline is healthy, and while a recovery
already runs). A spec that does not load gets a task that fails naming the
error. Connection: ``nats_default``.
"""

from __future__ import annotations

from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import DAG, Param

from isbflow.airflow.catalog import load_catalog, task_id_for
from isbflow.airflow.operators.watchdog import PipelineWatchdogOperator
from isbflow.airflow.pipelines import pipelines_dir

PIPELINES = pipelines_dir(__file__)
CATALOG = load_catalog(PIPELINES)
CHECKS = {"heartbeat_timeout": "{{ params.heartbeat_timeout }}", "lag_growth_runs": "{{ params.lag_growth_runs }}"}

with DAG(
    dag_id="pipeline_watchdog",
    description="Each minute: stalled steps, growing lag and buffer loss of running pipelines",
    schedule="* * * * *",
    catchup=False,
    max_active_runs=1,
    tags=["isbflow", "watchdog"],
    doc_md=__doc__,
    params={
        "heartbeat_timeout": Param(60, type="integer", minimum=1, title="Heartbeat timeout (s)",
                                   description="A running step whose last heartbeat is older than this is stalled."),
        "lag_growth_runs": Param(3, type="integer", minimum=1, title="Lag growth runs",
                                 description="A step whose lag grew at this many consecutive checks cannot "
                                             "keep up."),
    },
) as dag:
    for entry in CATALOG.entries:
        recover = None
        if entry.pipeline.spec.autoRecover:
            recover = TriggerDagRunOperator(
                task_id=task_id_for(f"recover_{entry.name}"), trigger_dag_id="pipeline_replay",
                conf={"pipeline": entry.file, "mode": "recover", "dry_run": False})
        watch = PipelineWatchdogOperator(
            task_id=task_id_for(f"watch_{entry.name}"), pipeline_file=entry.file, pipelines_dir=str(PIPELINES),
            pipeline=entry.name, recover_task_id=recover.task_id if recover else None, **CHECKS)
        if recover is not None:
            watch >> recover
    for file in CATALOG.errors:  # fails at run time with the spec error, where it is seen
        PipelineWatchdogOperator(task_id=task_id_for(f"watch_{file}"), pipeline_file=file,
                                 pipelines_dir=str(PIPELINES), **CHECKS)
