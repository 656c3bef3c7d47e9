"""Processes on this host, for the faces that start and stop them (the local platform of ``make run``).

A PID alone is not an identity: :func:`process_start` gives a process's kernel start time
(field 22 of ``/proc/<pid>/stat``, clock ticks since boot), and :func:`process_alive` with a
recorded start time answers for that process only, never for one that reused its PID.
:func:`stop_process` stops a detached process and its group (SIGINT, SIGTERM, SIGKILL);
:func:`wait_exit` waits for a launched driver to exit; :func:`driver_env` is the environment
a detached ``isbflow`` process gets (the ISB service settings, the data dir, Spark's Python).

One implementation each lives below ``ops/`` (:mod:`isbflow.local.procs`,
:mod:`isbflow.steps.launch`); this is the use-case layer's view of them, so no face reaches
deeper.
"""

from __future__ import annotations

from isbflow.local.procs import process_alive, process_start
from isbflow.steps.driver import driver_env
from isbflow.steps.launch import stop_process, wait_exit

__all__ = ["driver_env", "process_alive", "process_start", "stop_process", "wait_exit"]
