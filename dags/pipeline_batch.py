"""Run a pipeline's steps once over what their inputs hold (the batch half of batch-plus-streaming).

The same spec and transforms as ``pipeline_start``, with Spark's availableNow
trigger: each step processes its inputs up to where they stood at its start,
then stops. Hourly; skipped while the pipeline runs continuously (both would
write the same checkpoints). New DAGs start paused or not per Airflow's
``dags_are_paused_at_creation``. Connection: ``nats_default``.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param

from isbflow.airflow.operators.pipeline import PipelineBatchOperator
from isbflow.airflow.pipelines import pipeline_param, pipelines_dir, project_dir

with DAG(
    dag_id="pipeline_batch",
    description="Run a pipeline's steps once (availableNow) over what its buffers hold",
    schedule="@hourly",
    catchup=False,
    max_active_runs=1,
    tags=["isbflow", "pipeline"],
    doc_md=__doc__,
    params={
        "pipeline": pipeline_param(pipelines_dir(__file__)),
        "master": Param("local[2]", type="string", title="Spark master",
                        description="local[N], or spark://host:7077 for a standalone cluster."),
    },
) as dag:
    PipelineBatchOperator(task_id="batch", pipeline_file="{{ params.pipeline }}",
                          pipelines_dir=str(pipelines_dir(__file__)), master="{{ params.master }}",
                          workdir=str(project_dir(__file__)))
