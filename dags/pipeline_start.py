"""Start a pipeline: provision its buffers, launch its steps, wait until every step runs.

The steps run in one Spark application started detached (its log is under
ISBFLOW_HOME/logs/); no task holds a worker slot for the life of the stream,
and the wait is deferred to the triggerer. Triggering again while it runs
finds the live launch instead of starting a second one. Stop it with the
``pipeline_drain`` DAG. Connection: ``nats_default`` (else the embedded
server under ISBFLOW_HOME).
"""

from __future__ import annotations

from airflow.sdk import DAG, Param

from isbflow.airflow.operators.isb import IsbProvisionOperator
from isbflow.airflow.operators.pipeline import PipelineStartOperator
from isbflow.airflow.pipelines import pipeline_param, pipelines_dir, project_dir
from isbflow.airflow.sensors.pipeline import PipelineStateSensor

PIPELINES = str(pipelines_dir(__file__))
SPEC = "{{ params.pipeline }}"

with DAG(
    dag_id="pipeline_start",
    description="Provision a pipeline's buffers, launch its Spark steps and wait until they run",
    schedule=None,
    catchup=False,
    tags=["isbflow", "pipeline"],
    doc_md=__doc__,
    params={
        "pipeline": pipeline_param(pipelines_dir(__file__)),
        "master": Param("local[2]", type="string", title="Spark master",
                        description="local[N], or spark://host:7077 for a standalone cluster."),
    },
) as dag:
    provision = IsbProvisionOperator(task_id="provision", pipeline_file=SPEC, pipelines_dir=PIPELINES)
    start = PipelineStartOperator(task_id="start", pipeline_file=SPEC, pipelines_dir=PIPELINES,
                                  master="{{ params.master }}", workdir=str(project_dir(__file__)),
                                  provision=False)
    running = PipelineStateSensor(task_id="wait_running", pipeline_file=SPEC, pipelines_dir=PIPELINES,
                                  target_state="running", timeout=900)
    provision >> start >> running
