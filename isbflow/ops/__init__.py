"""One function per user-facing verb: provision, start, drain, batch, replay, quality, status, produce.

The faces (the ``isbflow`` CLI, the Airflow operators, the local platform of
``make run``) call these and nothing deeper, so a fix made here reaches every
face at once.
"""
