"""The isbflow UI: a FastAPI app the Airflow plugin mounts under ``/isbflow``.

Pages (HTML, server-rendered, no outside assets):

* ``GET /pipelines`` (``?pipeline=NAME|FILE``, ``?dag_id=ID`` when shown as a DAG's tab):
  every pipeline spec under the pipelines folder with its steps (state, heartbeat
  age, stale mark, lag, input/processed rows/s, rows, dead letters), its buffers
  (lag per edge partition), its dead-letter buffer, the processed rows/s of each
  step over the last hour, and the last drain and replay DAG runs;
* ``GET /quality`` (``?pipeline=``, ``?sink=``, ``?limit=``): quality runs per sink,
  newest first, pass/fail, the failed checks with their unexpected counts, links to
  each run's Data Docs page (or its JSON);
* ``GET /reports/<pipeline>/<sink>/<file>`` and ``/reports/_static/...``: the stored
  reports and their assets, through :func:`isbflow.quality.reports.report_path`
  (a path that would leave the reports folder, however encoded, is a 400).

JSON: ``GET /api/pipelines`` and ``GET /api/quality`` return what the pages show
(:mod:`isbflow.airflow.ui.models`); the pipelines page refreshes itself from the former.

Every route needs an Airflow token (:mod:`isbflow.airflow.ui.auth`): 401 (JSON
for ``/api``, an HTML page linking to the login otherwise) and nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import mimetypes
import secrets
import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response

from isbflow.airflow.pipelines import pipeline_files, pipelines_dir
from isbflow.airflow.ui import URL_PREFIX, collect, render
from isbflow.airflow.ui.auth import NotAuthenticated, login_url, require_user
from isbflow.airflow.ui.models import PipelinesResponse, QualityResponse
from isbflow.airflow.ui.runs import DRAIN_DAG, REPLAY_DAG, latest_for, latest_runs
from isbflow.ops.connection import connect, default_data_dir
from isbflow.ops.quality import UnsafeReportPath, report_path
from isbflow.spec.paths import DataDir

log = logging.getLogger(__name__)

STALE_AFTER_S = 30.0  # a live step's runner heartbeats every few seconds; 30 s without one is stale
REFRESH_S = 5.0
SETTINGS_TTL_S = 30.0
NATS_CONNECT_TIMEOUT_S = 3.0
REPORT_TYPES = {".html", ".json", ".css", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".ico", ".woff", ".woff2",
                ".ttf", ".eot", ".otf"}
NO_STORE = {"Cache-Control": "no-store"}
# Stored reports are data (GX pages show sample values): no script runs in them, no form posts
# anywhere, no <base> redirects their links, and they open sandboxed (no scripts, forms, popups,
# plugins or top-level navigation). allow-same-origin only keeps the sandboxed page's origin: without
# it the browser treats the page's own stylesheet and image requests as cross-site, the SameSite=Lax
# session cookie is left off and they are refused (checked in Chromium: tests/test_hygiene.py).
REPORT_CSP = ("default-src 'self'; script-src 'none'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
              "font-src 'self' data:; frame-ancestors 'self'; form-action 'none'; base-uri 'none'; "
              "sandbox allow-same-origin")

User = Annotated[Any, Depends(require_user)]


def page_csp(nonce: str) -> str:
    return (f"default-src 'self'; script-src 'nonce-{nonce}'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; connect-src 'self'; frame-ancestors 'self'")


def data_dir() -> Path:
    """isbflow's data folder, found as every ``isbflow`` command finds it (``ISBFLOW_HOME``)."""
    return default_data_dir().resolve()


class _SettingsCache:
    """NATS settings per ISB service for a few seconds: the hook reads the Airflow connection
    (a DB query) and logs each time, and the page refreshes every few seconds."""

    def __init__(self, ttl: float):
        self.ttl = ttl
        self._items: dict[str, tuple[float, Any]] = {}

    def get(self, service: Any) -> Any:
        # lazy: hooks.jetstream imports Airflow (seconds); tests/airflow/test_ui_app.py builds the app without it
        from isbflow.airflow.hooks.jetstream import reader_settings

        key = service.name if service is not None else ""
        hit = self._items.get(key)
        if hit is not None and time.monotonic() - hit[0] < self.ttl:
            return hit[1]
        settings = reader_settings(data_dir(), service)
        self._items[key] = (time.monotonic(), settings)
        return settings


def create_app(url_prefix: str = URL_PREFIX, anchor: str | Path | None = None,
               stale_after: float = STALE_AFTER_S, refresh_s: float = REFRESH_S) -> FastAPI:
    """The UI app. ``anchor``: a file in the repository whose ``pipelines/`` folder holds the
    specs when ``ISBFLOW_PIPELINES_DIR`` is not set (the plugin passes its own file)."""
    anchor_file = Path(anchor) if anchor is not None else Path(__file__).resolve().parents[3] / "plugins" / "_"
    settings_cache = _SettingsCache(SETTINGS_TTL_S)
    app = FastAPI(title="isbflow", docs_url=None, redoc_url=None, openapi_url=None)

    def bases(request: Request) -> tuple[str, str]:
        """(this app's URL path, the Airflow UI's), from the mount point."""
        root = request.scope.get("root_path", "").rstrip("/")
        ui = root[: -len(url_prefix)] if url_prefix and root.endswith(url_prefix) else ""
        return root, ui

    @app.exception_handler(NotAuthenticated)
    async def not_authenticated(request: Request, exc: NotAuthenticated) -> Response:
        base, _ = bases(request)
        headers = {**NO_STORE, "WWW-Authenticate": "Bearer"} if exc.status_code == 401 else NO_STORE
        if request.url.path.startswith(f"{base}/api/"):
            return JSONResponse({"detail": exc.reason}, status_code=exc.status_code, headers=headers)
        title = "Not logged in" if exc.status_code == 401 else "Not allowed"
        message = (f"This page needs an Airflow login ({exc.reason})." if exc.status_code == 401 else exc.reason)
        html = render.render("error.html", base=base, page="", title=title, message=message, status=exc.status_code,
                             login=login_url(request) if exc.status_code == 401 else None)
        return HTMLResponse(html, status_code=exc.status_code, headers=headers)

    async def pipelines_data(request: Request, pipeline: str | None, dag_id: str | None) -> PipelinesResponse:
        _, ui = bases(request)
        directory = pipelines_dir(anchor_file)
        files = pipeline_files(directory)
        loaded = await run_in_threadpool(collect.load_all, directory, files)
        if pipeline:
            loaded = [s for s in loaded if s.file == pipeline or any(p.name == pipeline for p in s.pipelines)]
            for s in loaded:
                if s.file != pipeline:
                    s.pipelines = [p for p in s.pipelines if p.name == pipeline]
        seen: dict[str, str | None] = {"nats": None, "error": None}

        async def connect_to(specs: Any, p: Any) -> Any:
            try:
                settings = await run_in_threadpool(settings_cache.get, specs.service_for(p))
                seen["nats"] = settings.display
                return await connect(settings, name="isbflow-ui", timeout=NATS_CONNECT_TIMEOUT_S,
                                     reconnect_attempts=0)
            except Exception as e:
                seen["error"] = seen["error"] or collect.one_line(e)
                raise

        views = await collect.pipeline_views(loaded, connect_to, stale_after)
        runs_error = None
        dag_ids = [DRAIN_DAG, REPLAY_DAG, *([dag_id] if dag_id else [])]
        try:
            runs = await run_in_threadpool(latest_runs, dag_ids, files, ui)
        except Exception as e:  # the metadata DB: show why, keep the page
            log.warning("isbflow UI: reading DAG runs failed: %s", e)
            runs, runs_error = {}, collect.one_line(e)
        for v in views:
            v.last_drain = latest_for(runs.get(DRAIN_DAG, []), v.file, directory)
            v.last_replay = latest_for(runs.get(REPLAY_DAG, []), v.file, directory)
        dag_run = (runs.get(dag_id) or [None])[0] if dag_id else None
        return PipelinesResponse(pipelines_dir=str(directory), generated_at=time.time(), stale_after_s=stale_after,
                                 nats=seen["nats"], nats_error=seen["error"], runs_error=runs_error,
                                 dag_id=dag_id, dag_run=dag_run, pipelines=views)

    def quality_data(request: Request, pipeline: str | None, sink: str | None, limit: int) -> QualityResponse:
        base, _ = bases(request)
        ddir = data_dir()
        directory = pipelines_dir(anchor_file)
        names = [p.name for s in collect.load_all(directory, pipeline_files(directory)) for p in s.pipelines]
        wanted = [pipeline] if pipeline else collect.report_pipelines(ddir, names)
        return QualityResponse(reports_dir=str(DataDir(ddir).quality_reports),
                               sinks=collect.quality_runs(ddir, wanted, base, sink, limit))

    def page(template: str, request: Request, **context: Any) -> HTMLResponse:
        base, _ = bases(request)
        nonce = secrets.token_urlsafe(16)
        html = render.render(template, base=base, nonce=nonce, **context)
        return HTMLResponse(html, headers={**NO_STORE, "Content-Security-Policy": page_csp(nonce)})

    @app.get("/", include_in_schema=False)
    async def index(request: Request, _user: User) -> RedirectResponse:
        base, _ = bases(request)
        return RedirectResponse(f"{base}/pipelines", status_code=307)

    @app.get("/api/pipelines", response_model=PipelinesResponse)
    async def api_pipelines(request: Request, _user: User, pipeline: str | None = None,
                            dag_id: str | None = None) -> JSONResponse:
        data = await pipelines_data(request, pipeline, dag_id)
        return JSONResponse(data.model_dump(mode="json"), headers=NO_STORE)

    @app.get("/pipelines", response_class=HTMLResponse)
    async def pipelines_page(request: Request, _user: User, pipeline: str | None = None,
                             dag_id: str | None = None) -> HTMLResponse:
        data = await pipelines_data(request, pipeline, dag_id)
        return page("pipelines.html", request, page="pipelines", data=data,
                    chart_w=render.CHART_W, chart_h=render.CHART_H, chart_pad=render.CHART_PAD,
                    window_s=render.WINDOW_S, refresh_ms=int(refresh_s * 1000))

    @app.get("/api/quality", response_model=QualityResponse)
    async def api_quality(request: Request, _user: User, pipeline: str | None = None, sink: str | None = None,
                          limit: Annotated[int, Query(ge=1, le=500)] = 20) -> JSONResponse:
        data = await run_in_threadpool(quality_data, request, pipeline, sink, limit)
        return JSONResponse(data.model_dump(mode="json"), headers=NO_STORE)

    @app.get("/quality", response_class=HTMLResponse)
    async def quality_page(request: Request, _user: User, pipeline: str | None = None, sink: str | None = None,
                           limit: Annotated[int, Query(ge=1, le=500)] = 20) -> HTMLResponse:
        data = await run_in_threadpool(quality_data, request, pipeline, sink, limit)
        return page("quality.html", request, page="quality", data=data)

    @app.get("/reports/{path:path}")
    async def report_file(path: str, _user: User) -> FileResponse:
        target = await asyncio.to_thread(resolve_report, path)
        media = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        headers = {**NO_STORE, "X-Content-Type-Options": "nosniff", "Content-Security-Policy": REPORT_CSP}
        return FileResponse(target, media_type=media, headers=headers)

    return app


def resolve_report(path: str) -> Path:
    """The stored report file ``path`` names; 400 when it would leave the reports folder, else 404."""
    try:
        target = report_path(data_dir(), path)
    except UnsafeReportPath as e:
        raise HTTPException(400, f"refused report path: {e}") from None
    if target.name.startswith(".") or target.suffix.lower() not in REPORT_TYPES or not target.is_file():
        raise HTTPException(404, "no such report file")
    return target
