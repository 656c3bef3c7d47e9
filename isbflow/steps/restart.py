"""Which query failures are transient, and how the runner restarts a query that hit one.

One policy for every place that runs steps (the runner in a normal run, recover's
replay and reprocess run the runner too): a transient failure (a Python worker
that missed Spark's connect-back window on a loaded machine, a read consumer
placed on a replica still catching up) restarts the query from its checkpoint
with a growing wait; anything else fails the step at once with a one-line
summary (:func:`error_summary`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
                      "s while reading sequences", "did not answer STREAM.INFO", "cannot create a read consumer")


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
