"""Which query failures are transient, and how the runner restarts a query that hit one.

One policy for every place that runs Spark work: the runner restarts a streaming
query (a normal run, and recover's replay, which runs the runner), and
:func:`retry_transient` runs a batch action again (reprocess's range reads and
sink rewrites, the window recomputes). A transient failure (a Python worker
that missed Spark's connect-back window on a loaded machine, a read consumer
placed on a replica still catching up) is tried again with a growing wait;
anything else fails at once with a one-line summary (:func:`error_summary`).

Spark offers no setting that widens the connect-back window: a Python streaming
source's driver-side worker (``PythonStreamingSourceRunner``) is always started by
``PythonWorkerFactory.createSimpleWorker``, which in Spark 4.3.0 waits a fixed
10,000 ms (``Selector.select(10000L)`` before "Timed out while waiting for the
Python worker to connect back"); ``spark.python.use.daemon`` only decides how the
planner's and the tasks' workers start. So the cure is to try again.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

_CAUSE_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Lost|NotFound|Full)): (.+)$")


def error_summary(exc: BaseException) -> str:
    """One line for a failed query's status: the Python exception that caused it when its text
    carries a traceback (a data source's error arrives as a Spark exception whose first line
    is only ``... Traceback (most recent call last):``), else the first line; 500 chars at most."""
    lines = str(exc).splitlines()
    causes = [m for line in lines[1:] if (m := _CAUSE_LINE.match(line.strip()))
              and not m.group(1).startswith(("org.", "java.", "scala.", "py4j."))]
    if causes:
        name, message = causes[-1].groups()
        return f"{name.rpartition('.')[2]}: {message}"[:500]
    return (lines[0] if lines else repr(exc))[:500]


class StepError(Exception):
    """A step could not be built or failed; the message names the step."""


#: Failures of the plumbing, not of the data: on a loaded small machine a new Python
#: worker can miss Spark's fixed 10 s connect-back window; in a NATS cluster a read
#: consumer placed on a replica still catching up (a node just restarted) delivers
#: nothing for a while. A query that hits one is started again from its checkpoint
#: (the batch re-runs; frame ids and the sink's app transaction make that
#: exactly-once; the new read consumer is placed anew), a few times.
TRANSIENT_FAILURES = ("Python worker failed to connect back",
                      # isbflow.isb.read: the ISB service slow or failing over
                      "s while reading sequences", "did not answer STREAM.INFO", "cannot create a read consumer",
                      # a Delta sink's commit reading a log entry that maintenance trimmed meanwhile (seen
                      # with the soak's accelerated 0 h log retention): the batch runs again on a fresh log,
                      # committed at most once by its app transaction
                      "/_delta_log/0")


@dataclass(frozen=True)
class RestartPolicy:
    """How the runner restarts a query that failed transiently (:data:`TRANSIENT_FAILURES`).

    Restart n waits ``min(n * backoff_s, backoff_max_s)``: the Python process of the failed
    attempt goes on loading for a while (its own auth timeout), so restarting at once on a
    loaded machine piles such processes up and each attempt loads slower than the last.
    Short enough that the step's heartbeat never looks stale meanwhile. Tests run this
    same policy (it is a constructor argument, never a subclass with other numbers).
    """

    max_restarts: int = 5
    backoff_s: float = 2.0
    backoff_max_s: float = 10.0

    def wait_before(self, n: int) -> float:
        """Seconds to wait before restart ``n`` (1-based)."""
        return min(self.backoff_s * n, self.backoff_max_s)


DEFAULT_RESTARTS = RestartPolicy()


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is one of :data:`TRANSIENT_FAILURES` (worth running again)."""
    text = str(exc)
    return any(m in text for m in TRANSIENT_FAILURES)


def retry_transient(action: Callable[[], T], what: str, policy: RestartPolicy = DEFAULT_RESTARTS,
                    sleep: Callable[[float], None] = time.sleep) -> T:
    """``action()``; run again after :meth:`RestartPolicy.wait_before` when it fails transiently,
    at most ``policy.max_restarts`` more times. For Spark batch actions that only read or only
    build a result (a count, a ``toArrow``), so running one again changes nothing.
    ``what`` names the action in the log."""
    n = 0
    while True:
        try:
            return action()
        except Exception as e:
            if n >= policy.max_restarts or not is_transient(e):
                raise
            n += 1
            wait = policy.wait_before(n)
            log.warning("%s failed transiently (%s); attempt %d of %d in %.0fs", what,
                        str(e).splitlines()[0][:200], n + 1, policy.max_restarts + 1, wait)
            sleep(wait)
