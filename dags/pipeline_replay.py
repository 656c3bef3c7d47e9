"""Replay a pipeline from its sources: ``recover`` after buffer loss, or ``reprocess`` a range.

**recover** refills what lost buffers took: it detects the loss, drains what
still runs, recreates the lost region's buffers, rewinds the sources to the
lowest offset not yet in every sink (the offset ledger) and replays; sinks
insert only the records they lack, and every ``_isb_id`` sink is verified (no
duplicate, nothing missing). It takes no range.

**reprocess** runs a range again through the current code and replaces the
sinks' earlier output for it: by source offsets (``from_offset``..``to_offset``)
or by event time (``from_time``..``to_time``; ISO times, or ``yesterday``,
``today``, ``-6h``, ``today-1d``, resolved against this run).

**Dry run** shows what would be replayed (lost buffers, low offsets, record
counts) and changes nothing. The task's XCom is the report; a replay that
changed sinks emits their asset events, which runs ``pipeline_quality``.
Connection: ``nats_default``.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param

from isbflow.airflow.operators.replay import PipelineReplayOperator
from isbflow.airflow.pipelines import pipeline_param, pipelines_dir

with DAG(
    dag_id="pipeline_replay",
    description="Recover a pipeline after buffer loss, or reprocess a range of it",
    schedule=None,
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,
    tags=["isbflow", "replay"],
    doc_md=__doc__,
    params={
        "pipeline": pipeline_param(pipelines_dir(__file__)),
        "mode": Param("recover", type="string", enum=["recover", "reprocess"], title="Mode",
                      description="recover: refill what buffer loss took (same result as an uninterrupted run). "
                                  "reprocess: run a range again through the current code, replacing its output."),
        "from_offset": Param(None, type=["null", "integer"], minimum=1, title="From source offset",
                             description="reprocess: first source sequence of the range (empty: from the start). "
                                         "Give offsets or times, not both."),
        "to_offset": Param(None, type=["null", "integer"], minimum=1, title="To source offset",
                           description="reprocess: last source sequence of the range (empty: to the end)."),
        "from_time": Param(None, type=["null", "string"], title="From event time",
                           description="reprocess: start of the event-time range: an ISO time "
                                       "(2024-05-01T00:00:00Z), or yesterday / today / -6h / today-1d."),
        "to_time": Param(None, type=["null", "string"], title="To event time",
                         description="reprocess: end of the event-time range (same forms as From event time)."),
        "dry_run": Param(False, type="boolean", title="Dry run",
                         description="Show what would be replayed (lost buffers, offsets, record counts) "
                                     "without changing anything."),
        "master": Param("local[2]", type="string", title="Spark master",
                        description="Where the replay's Spark session runs: local[N] or spark://host:7077."),
    },
) as dag:
    PipelineReplayOperator(
        task_id="replay",
        pipeline_file="{{ params.pipeline }}",
        pipelines_dir=str(pipelines_dir(__file__)),
        mode="{{ params.mode }}",
        from_offset="{{ params.from_offset }}",
        to_offset="{{ params.to_offset }}",
        from_time="{{ params.from_time }}",
        to_time="{{ params.to_time }}",
        dry_run="{{ params.dry_run }}",
        master="{{ params.master }}",
    )
