"""Provision the inter-step buffers of a pipeline (trigger it with a spec file from pipelines/).

Idempotent: creates the streams and KV buckets that are missing and updates
the rest in place; ``recreate`` rebuilds buffers whose config JetStream cannot
change in place, ``force`` lets it drop buffers that still hold messages.
The report is the task's XCom. Connection: ``nats_default`` (else the
embedded server under ISBFLOW_HOME).
"""

from __future__ import annotations

from airflow.sdk import DAG, Param

from isbflow.airflow.operators.isb import IsbProvisionOperator
from isbflow.airflow.pipelines import pipeline_param, pipelines_dir

PIPELINES = pipelines_dir(__file__)

with DAG(
    dag_id="isb_provision",
    description="Create or update a pipeline's ISB buffers on NATS JetStream",
    schedule=None,
    catchup=False,
    tags=["isbflow", "isb"],
    doc_md=__doc__,
    params={
        "pipeline": pipeline_param(PIPELINES),
        "recreate": Param(False, type="boolean", title="Recreate",
                          description="Rebuild buffers whose config cannot change in place "
                                      "(storage, retention). Refused for non-empty buffers unless Force."),
        "force": Param(False, type="boolean", title="Force",
                       description="With Recreate: drop buffers even when they still hold messages "
                                   "(their data is lost)."),
    },
) as dag:
    IsbProvisionOperator(
        task_id="provision",
        pipeline_file="{{ params.pipeline }}",
        pipelines_dir=str(PIPELINES),
        recreate="{{ params.recreate }}",
        force="{{ params.force }}",
    )
