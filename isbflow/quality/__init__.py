"""Data quality of the sinks: GX expectation suites plus built-in checks, reports and gates.

A quality run (:func:`isbflow.quality.run.run_quality`) checks one sink's
current Delta version: Spark reads the Parquet files of that version, GX Core
runs the sink's expectations from the spec (and the built-in uniqueness of
``_isb_id``) in a file context under ``<data dir>/quality/gx``, and Spark
computes the other built-in checks (:mod:`isbflow.quality.checks`:
completeness, schema, freshness, aggregate windows recomputed from the raw
sink). The run is kept as a JSON report with a self-contained Data Docs page
(:mod:`isbflow.quality.reports`, :mod:`isbflow.quality.docs`); a failed
``onFailure: fail`` gate fails the run, a ``warn`` gate only reports.

Completeness is judged against the offset ledger and the steps' committed
offsets (:mod:`isbflow.quality.basis`): what every step has committed must be in
the sink, what is still on its way is reported in flight, never a failure; the
window recount waits for windows to close. :mod:`isbflow.quality.verify` proves
offline, from a table's commits and data alone, which source ranges it holds
completely and exactly once.

Modules: ``checks`` (built-in checks), ``basis`` (the ledger's view of a
pipeline: committed low watermarks, dead letters, window closure), ``gx`` (the
GX context, suite and checkpoint), ``docs`` (Data Docs without CDNs),
``reports`` (storage, history, retention, safe paths), ``run`` (one run, end to
end), ``verify`` (the offline proof). Importing this package is cheap; GX and
Spark load with the modules that need them.
"""
