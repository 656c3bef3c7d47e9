"""Drain a running pipeline: upstream steps first, each downstream step once its inputs are
consumed; nothing read is lost or processed twice. The task's XCom holds every step's final
offsets; a timeout fails it naming the stuck step. Connection: ``nats_default``.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param

from isbflow.airflow.operators.pipeline import PipelineDrainOperator
from isbflow.airflow.pipelines import pipeline_param, pipelines_dir

with DAG(
    dag_id="pipeline_drain",
    description="Drain a running pipeline and report its final offsets",
    schedule=None,
    catchup=False,
    tags=["isbflow", "pipeline"],
    doc_md=__doc__,
    params={
        "pipeline": pipeline_param(pipelines_dir(__file__)),
        "timeout": Param(300, type="integer", minimum=1, title="Timeout (s)",
                         description="How long the whole drain may take."),
    },
) as dag:
    PipelineDrainOperator(task_id="drain", pipeline_file="{{ params.pipeline }}",
                          pipelines_dir=str(pipelines_dir(__file__)), drain_timeout="{{ params.timeout }}")
