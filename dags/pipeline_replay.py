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

**Shadow** (reprocess only) writes the range's new output into shadow tables
beside the sinks, never touching the live ones, runs the sinks' suites on them
and shows the diff per sink on the Quality page (a failing suite fails the
replay task, naming the check). The **promote** task then replaces the range in
the live sinks, one Delta commit per raw sink: at once when ``promote`` is on
(only after the suites passed), or later, after a review, in a run with
``promote_run`` set to the shadow's run id (that run replays nothing).

**Dry run** shows what would be replayed (lost buffers, low offsets, record
counts) and changes nothing. The task's XCom is the report; a replay that
changed sinks emits their asset events, which runs ``pipeline_quality``.
Connection: ``nats_default``.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param

from isbflow.airflow.operators.replay import PipelinePromoteOperator, PipelineReplayOperator
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
        "shadow": Param(False, type="boolean", title="Shadow (review before replacing)",
                        description="reprocess: write the new output into shadow tables beside the sinks, run the "
                                    "suites there and show the diff on the Quality page; the live sinks are not "
                                    "touched until a promote."),
        "promote": Param(False, type="boolean", title="Promote when the suites pass",
                         description="With Shadow: promote the shadow into the live sinks in this run, once every "
                                     "suite passed on it (one Delta commit per sink). Off: review the diff first, "
                                     "then trigger again with Promote shadow run."),
        "promote_run": Param(None, type=["null", "string"], title="Promote shadow run",
                             description="Promote this earlier shadow run (reprocess-<time>, shown on the Quality "
                                         "page) into the live sinks; the run replays nothing else. Refused when a "
                                         "suite failed on the shadow or the live sink changed its range since."),
        "master": Param("local[2]", type="string", title="Spark master",
                        description="Where the replay's Spark session runs: local[N] or spark://host:7077."),
    },
) as dag:
    replay = PipelineReplayOperator(
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
        shadow="{{ params.shadow }}",
        promote_run="{{ params.promote_run }}",
    )
    promote = PipelinePromoteOperator(
        task_id="promote",
        pipeline_file="{{ params.pipeline }}",
        pipelines_dir=str(pipelines_dir(__file__)),
        run="{{ params.promote_run }}",
        promote="{{ params.shadow and params.promote }}",
        master="{{ params.master }}",
        trigger_rule="none_failed",  # after a shadow that passed, or a replay skipped for promote_run
    )
    replay >> promote
