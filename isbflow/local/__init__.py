"""The local machine: processes and their liveness, files that grow, Delta tables
loaded from its disk (no pipeline concepts).

A layer of its own at the bottom, beside ``spec/``: the ISB service's
embedded server (``isb/``), launched drivers (``steps/``) and the local
platform all ask "does the process I started still run", and answer it the
same way here (:mod:`.procs`); every layer that reads a Delta table (the
ledger in ``isb/``, sinks, recovery, quality) loads it through
:func:`.delta.load_table`, which survives sink maintenance trimming the log
under the load.
"""
