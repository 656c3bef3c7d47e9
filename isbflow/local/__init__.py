"""The local machine: processes and their liveness (no pipeline concepts).

A layer of its own at the bottom, beside ``spec/``: the ISB service's
embedded server (``isb/``), launched drivers (``steps/``) and the local
platform all ask "does the process I started still run", and answer it the
same way here.
"""
