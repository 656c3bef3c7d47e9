"""The latest runs of isbflow's DAGs, read from Airflow's metadata DB.

The plugin runs inside the api-server, so Airflow's ORM and session are there.
A run is matched to a pipeline by the spec file it worked on: its conf's
``pipeline`` (what the trigger form sends), else the DAGs' default spec
(:func:`default_spec`, the rule of :func:`isbflow.airflow.pipelines.pipeline_param`).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from urllib.parse import quote

from isbflow.airflow.ui.models import RunLink

DRAIN_DAG = "pipeline_drain"
REPLAY_DAG = "pipeline_replay"
DEFAULT_SPEC = "logs.yaml"
RECENT_RUNS = 50  # runs read per DAG to find each pipeline's latest


def default_spec(files: list[str]) -> str | None:
    """The spec a DAG run without a ``pipeline`` in its conf worked on."""
    if not files:
        return None
    return DEFAULT_SPEC if DEFAULT_SPEC in files else files[0]


def run_url(ui_base: str, dag_id: str, run_id: str) -> str:
    """The Airflow UI page of a DAG run: ``<base>/dags/<dag_id>/runs/<run_id>``."""
    return f"{ui_base.rstrip('/')}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"


def _iso(d: datetime | None) -> str | None:
    return d.isoformat() if d is not None else None


def latest_runs(dag_ids: Iterable[str], files: list[str], ui_base: str,
                limit: int = RECENT_RUNS) -> dict[str, list[RunLink]]:
    """Per DAG id, its most recent runs (newest first), each with the spec it worked on.

    Raises whatever the metadata DB raises; the caller shows it.
    """
    # lazy: Airflow's ORM, there only inside the api-server; tests/airflow/test_ui_app.py builds the app without it
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    fallback = default_spec(files)
    out: dict[str, list[RunLink]] = {}
    with create_session() as session:
        for dag_id in dag_ids:
            rows = session.scalars(
                select(DagRun).where(DagRun.dag_id == dag_id)
                .order_by(DagRun.run_after.desc(), DagRun.id.desc()).limit(limit)
            ).all()
            out[dag_id] = [
                RunLink(dag_id=dag_id, run_id=r.run_id, state=str(r.state) if r.state else None,
                        run_after=_iso(r.run_after), start_date=_iso(r.start_date), end_date=_iso(r.end_date),
                        spec=_spec_of(r.conf, fallback), url=run_url(ui_base, dag_id, r.run_id))
                for r in rows
            ]
    return out


def _spec_of(conf: object, fallback: str | None) -> str | None:
    if isinstance(conf, dict) and isinstance(conf.get("pipeline"), str) and conf["pipeline"]:
        return conf["pipeline"]
    return fallback


def latest_for(runs: list[RunLink], spec: str, directory: Path) -> RunLink | None:
    """The newest run that worked on ``spec`` (a file name under ``directory``), or None.

    A run's spec may also be an absolute path (the DAGs accept one).
    """
    target = (directory / spec).resolve()
    return next((r for r in runs if r.spec and (r.spec == spec or Path(r.spec).resolve() == target)), None)
