"""What ``plugins/isbflow_plugin.py`` registers, cheap to import.

Airflow imports every plugin file in each process that loads plugins, including
every task run (for macros), so this module imports nothing heavy: the FastAPI
app (FastAPI, Jinja, the spec models) is built on the first request that reaches
:class:`LazyApp`, which only happens in the api-server.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from isbflow.airflow.ui import URL_PREFIX


def external_views(url_prefix: str = URL_PREFIX) -> list[dict[str, str]]:
    """The plugin's ``external_views``: "Pipelines" and "Quality" in the Browse menu and as DAG tabs.

    ``url_route`` must be unique among all plugins' views, so the DAG tabs have their own.
    A DAG tab's ``href`` carries ``{DAG_ID}``, which the Airflow UI fills in.
    """
    return [
        {"name": "Pipelines", "href": f"{url_prefix}/pipelines", "destination": "nav",
         "category": "browse", "url_route": "isbflow-pipelines"},
        {"name": "Quality", "href": f"{url_prefix}/quality", "destination": "nav",
         "category": "browse", "url_route": "isbflow-quality"},
        {"name": "Pipelines", "href": f"{url_prefix}/pipelines?dag_id={{DAG_ID}}", "destination": "dag",
         "url_route": "isbflow-dag-pipelines"},
        {"name": "Quality", "href": f"{url_prefix}/quality?dag_id={{DAG_ID}}", "destination": "dag",
         "url_route": "isbflow-dag-quality"},
    ]


class LazyApp:
    """An ASGI app that builds :func:`isbflow.airflow.ui.app.create_app` on first use, then
    hands every request to it (the api-server mounts it like any ASGI app)."""

    def __init__(self, url_prefix: str = URL_PREFIX, anchor: str | Path | None = None, **kwargs: Any):
        self.url_prefix = url_prefix
        self.anchor = anchor
        self.kwargs = kwargs
        self._app: Any = None
        self._lock = threading.Lock()

    @property
    def app(self) -> Any:
        """The FastAPI app (built now if it was not yet)."""
        if self._app is None:
            with self._lock:
                if self._app is None:
                    # lazy: the app pulls FastAPI, Jinja and the spec models; Airflow imports this plugin in every
                    # task process (module docstring), only the api-server serves it
                    from isbflow.airflow.ui.app import create_app

                    self._app = create_app(self.url_prefix, anchor=self.anchor, **self.kwargs)
        return self._app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)
