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

Modules: ``expectations`` (GX names and arguments, used by spec validation),
``checks`` (built-in checks), ``gx`` (the GX context, suite and checkpoint),
``docs`` (Data Docs without CDNs), ``reports`` (storage, history, retention,
safe paths), ``run`` (one run, end to end). Importing this package is cheap;
GX and Spark load with the modules that need them.
"""
