"""Scale a pipeline to zero while it is idle: start (or stop) its watcher.

The watcher (``isbflow pipeline scale-to-zero``, a small process without Spark, started
detached: no task holds a worker slot while it watches) drains the pipeline's Spark driver away
once nothing has been pending for ``scaleDownCooldownSeconds``, and starts it again, as
``pipeline_start`` does, when its source stream grows. Only for a pipeline whose every vertex
has ``scale.min: 0``. Triggering again while it watches finds the running watcher. With
``watch`` off the watcher stops and leaves the pipeline as it is (running, or drained). Its log
is ``ISBFLOW_HOME/logs/zero-<pipeline>.log``. Connection: ``nats_default`` (else the embedded
server under ISBFLOW_HOME).
"""

from __future__ import annotations

from airflow.sdk import DAG, Param, task
from airflow.sdk.exceptions import AirflowFailException

from isbflow.airflow.operators.pipeline import resolve_target
from isbflow.airflow.pipelines import pipeline_param, pipelines_dir, project_dir

PIPELINES = str(pipelines_dir(__file__))
WORKDIR = str(project_dir(__file__))


@task(task_id="watcher")
def watcher(params: dict | None = None) -> dict:
    # lazy: ops.zero_launch loads nats-py and the launcher; DAG parsing must not
    from isbflow.ops.zero import ZeroError
    from isbflow.ops.zero_launch import launch_watcher, stop_watcher

    params = params or {}
    t = resolve_target(params["pipeline"], PIPELINES, None, "nats_default", None)
    if not params.get("watch", True):
        return {"pipeline": t.pipeline.name, "stopped": stop_watcher(t.data_dir, t.pipeline.name)}
    try:
        return launch_watcher(t.path, t.pipeline, t.settings, t.data_dir, master=params.get("master", "local[2]"),
                              workdir=WORKDIR).to_json()
    except ZeroError as e:
        raise AirflowFailException(str(e)) from None


with DAG(
    dag_id="pipeline_scale_to_zero",
    description="Start (or stop) the watcher that scales an idle pipeline to zero and wakes it on new data",
    schedule=None,
    catchup=False,
    tags=["isbflow", "pipeline"],
    doc_md=__doc__,
    params={
        "pipeline": pipeline_param(pipelines_dir(__file__)),
        "master": Param("local[2]", type="string", title="Spark master",
                        description="Where the watcher starts the driver: local[N], or spark://host:7077."),
        "watch": Param(True, type="boolean", title="Watch",
                       description="On: start the watcher (or find it running). Off: stop it."),
    },
) as dag:
    watcher()
