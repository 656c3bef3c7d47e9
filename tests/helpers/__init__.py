"""Shared test helpers: Airflow homes, the live platform, recovery runs, test sources and transforms."""
