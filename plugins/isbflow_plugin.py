"""isbflow in the Airflow UI: pipeline status and quality reports.

Mounts the isbflow UI app (:mod:`isbflow.airflow.ui.app`) in the api-server under
``/isbflow`` (``/isbflow/pipelines``, ``/isbflow/quality``, JSON under ``/isbflow/api``)
and adds "Pipelines" and "Quality" to the Browse menu and as tabs of every DAG. The
app checks the caller's Airflow token itself: mounted apps are not behind Airflow's
auth. Specs come from ``ISBFLOW_PIPELINES_DIR`` or this repository's ``pipelines/``;
reports from ``ISBFLOW_HOME`` (default ``./.isbflow``); NATS from the ``nats_default``
connection. Importing this file is cheap (every task run does): the app is built on
its first request.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from isbflow.airflow.ui.plugin import URL_PREFIX, LazyApp, external_views


class IsbflowPlugin(AirflowPlugin):
    name = "isbflow"
    fastapi_apps = [{"app": LazyApp(URL_PREFIX, anchor=__file__), "url_prefix": URL_PREFIX,
                     "name": "isbflow pipelines and quality"}]
    external_views = external_views(URL_PREFIX)
