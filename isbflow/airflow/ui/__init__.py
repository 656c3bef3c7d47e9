"""The isbflow pages in the Airflow UI: pipeline status and quality reports.

- :mod:`~isbflow.airflow.ui.plugin`: what ``plugins/isbflow_plugin.py`` registers
  (the lazily built app, the navigation entries and DAG tabs), cheap to import;
- :mod:`~isbflow.airflow.ui.app`: the FastAPI app (routes, pages, JSON);
- :mod:`~isbflow.airflow.ui.auth`: the caller's Airflow token, checked as Airflow does;
- :mod:`~isbflow.airflow.ui.collect`, :mod:`~isbflow.airflow.ui.runs`: what the pages show
  (specs, NATS status, DAG runs, quality reports), :mod:`~isbflow.airflow.ui.models` its shape;
- :mod:`~isbflow.airflow.ui.render`: Jinja templates and the SVG rate chart.
"""

#: Where the api-server mounts the app (the plugin and the app both read it).
URL_PREFIX = "/isbflow"
