"""Change how many partitions the buffers into a vertex have, losing and doubling nothing.

Set ``partitions: N`` on the vertex in the spec file first; this DAG makes the live pipeline
agree: it drains the pipeline, refuses when a partition still holds unread messages (unless
Force) or the vertex keeps state (an aggregation), creates and removes partitions, and starts
the pipeline again. The same function as ``isbflow pipeline rescale``. Connection: ``nats_default``.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param

from isbflow.airflow.operators.rescale import PipelineRescaleOperator
from isbflow.airflow.pipelines import pipeline_param, pipelines_dir, project_dir

with DAG(
    dag_id="pipeline_rescale",
    description="Change the partition count of a vertex's input buffers, drained and resumed",
    schedule=None,
    catchup=False,
    tags=["isbflow", "pipeline"],
    doc_md=__doc__,
    params={
        "pipeline": pipeline_param(pipelines_dir(__file__)),
        "vertex": Param("", type="string", minLength=1, title="Vertex",
                        description="The vertex whose input buffers are re-partitioned."),
        "partitions": Param(1, type="integer", minimum=1, maximum=64, title="Partitions",
                            description="The new count; the spec file must already say it on the vertex."),
        "force": Param(False, type="boolean", title="Force",
                       description="Re-partition even when partitions hold unread messages: those in "
                                   "removed partitions are lost."),
        "timeout": Param(300, type="integer", minimum=1, title="Drain timeout (s)",
                         description="How long the drain before the change may take."),
    },
) as dag:
    PipelineRescaleOperator(task_id="rescale", pipeline_file="{{ params.pipeline }}",
                            pipelines_dir=str(pipelines_dir(__file__)), vertex="{{ params.vertex }}",
                            partitions="{{ params.partitions }}", force="{{ params.force }}",
                            drain_timeout="{{ params.timeout }}", workdir=str(project_dir(__file__)))
