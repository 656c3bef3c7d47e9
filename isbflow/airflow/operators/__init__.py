"""Operators: thin Airflow tasks over the isbflow library."""
