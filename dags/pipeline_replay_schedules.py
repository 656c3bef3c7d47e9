"""Scheduled replays from the specs: one DAG ``replay_<pipeline>_<name>`` per ``replays:`` entry.

Every spec under the pipelines folder is read when this file is parsed; each
entry of a pipeline's ``replays:`` section becomes a DAG on the entry's
``schedule`` that runs the same task as ``pipeline_replay`` with the entry's
``mode`` and event-time range. ``fromTime``/``toTime`` are resolved against
each run's data interval (``yesterday``/``today`` against the day the run is
for), so a nightly reprocess of yesterday is one spec entry::

    replays:
      - {name: nightly, mode: reprocess, schedule: "0 2 * * *", fromTime: yesterday, toTime: today}

No catch-up, one run at a time. A spec that does not load gets no DAGs (the
watchdog's task for it fails naming the error). Connection: ``nats_default``.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param

from isbflow.airflow.catalog import load_catalog, task_id_for
from isbflow.airflow.operators.replay import PipelineReplayOperator
from isbflow.airflow.pipelines import pipelines_dir

PIPELINES = pipelines_dir(__file__)

for entry in load_catalog(PIPELINES).entries:
    for replay in entry.pipeline.spec.replays:
        dag_id = task_id_for(f"replay_{entry.name}_{replay.name}")
        with DAG(
            dag_id=dag_id,
            description=f"{replay.mode} of pipeline {entry.name} ({entry.file}) on {replay.schedule}, "
                        f"event time {replay.fromTime or 'open'} .. {replay.toTime or 'open'}",
            schedule=replay.schedule,
            catchup=False,
            max_active_runs=1,
            tags=["isbflow", "replay", entry.name],
            doc_md=__doc__,
            params={
                "dry_run": Param(False, type="boolean", title="Dry run",
                                 description="Show what this replay would do without changing anything."),
                "master": Param("local[2]", type="string", title="Spark master",
                                description="Where the replay's Spark session runs: local[N] or spark://host:7077."),
            },
        ) as dag:
            PipelineReplayOperator(
                task_id="replay",
                pipeline_file=entry.file,
                pipelines_dir=str(PIPELINES),
                pipeline=entry.name,
                mode=replay.mode,
                from_time=replay.fromTime,
                to_time=replay.toTime,
                dry_run="{{ params.dry_run }}",
                master="{{ params.master }}",
            )
        globals()[dag_id] = dag
