"""Sinks: tables with ACID commits that steps write into.

:mod:`isbflow.sinks.delta` is the Delta sink: a ``foreachBatch`` function
(:mod:`isbflow.sinks.delta_spark`) whose executors write Parquet with Spark's own
writer and whose driver commits one Delta transaction per micro-batch, plus the
driver-side helpers recovery and reprocess use.
:mod:`isbflow.sinks.postgres` is the PostgreSQL sink: a ``foreachBatch`` function
committing each micro-batch in one PostgreSQL transaction (read back by
:mod:`isbflow.sinks.pg_read`). :mod:`isbflow.sinks.maintain` compacts and vacuums
the Delta sinks on a schedule, and :mod:`isbflow.sinks.delta_log` bounds their
commit logs while keeping what the offset proofs read from them.

The package itself imports nothing: importing :mod:`isbflow.sinks.postgres` must not load
Spark or delta-rs (``isbflow --help`` and Airflow's DAG parsing reach it); import what you
use from its module.
"""
