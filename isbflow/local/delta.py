"""Delta tables on this machine, loaded while their log is being bounded.

Loading a Delta table (delta-rs ``DeltaTable(path)``) reads ``_last_checkpoint``,
lists ``_delta_log`` and then reads the checkpoint and the commits after it.
Sink maintenance (``isbflow sink maintain``, :func:`isbflow.sinks.delta_log.trim_log`)
writes a new checkpoint and removes the log files and the checkpoint before it.
A load that listed the log before the removal then fails on a file that was
there a moment ago: "File not found: .../_delta_log/...json", "Object at location
.../...checkpoint.parquet not found", "Invalid table version: 4" (CI, stop 29:
the soak's ``agg`` step died on it at the maintenance of its sink; measured
alone, 35 of 661 loads failed while a writer checkpointed and cleaned every 5
commits). Nothing is lost: the table is whole at its new checkpoint, so
:func:`load_table` loads again, which lists the log anew.

A version that really is gone (time travel past the log's retention) fails the
same way on every attempt and is raised after :data:`LOAD_ATTEMPTS`.

**A history numbered right** (:func:`table_history`). delta-rs 1.6's
``DeltaTable.history()`` lists the commits the log holds *when it is asked* and
numbers them down from the version the table was *loaded* at: a commit that lands
between the load and the call is listed as the loaded version, and every older one
one below its own. Beside a running sink that happens (the CI flake of
``test_live.py``: a quality check read the raw table at one version, and the
history up to that version then held the next commit's offsets under its label:
that batch's records, 537 in CI stop 32, were reported missing). :func:`table_history` asks, reads the table
forward, and asks again until the table did not move meanwhile.
"""

from __future__ import annotations

import logging
import time

from deltalake import DeltaTable
from deltalake.exceptions import DeltaError, TableNotFoundError

_log = logging.getLogger(__name__)

#: loads tried when a log file vanished under the load (module docstring)
LOAD_ATTEMPTS = 5
#: history reads tried while commits keep landing under them (:func:`table_history`)
HISTORY_ATTEMPTS = 20


def log_file_vanished(error: BaseException) -> bool:
    """``error`` is a load or commit that met a log file or checkpoint removed under it (module
    docstring: "File not found: .../_delta_log/...", "Object at location .../_delta_log/... not
    found", "Invalid table version: N")."""
    if isinstance(error, TableNotFoundError) or not isinstance(error, DeltaError):
        return False
    text = str(error)
    return "Invalid table version" in text or ("_delta_log" in text and "not found" in text)


def load_table(path: str, version: int | None = None) -> DeltaTable:
    """``DeltaTable(path, version)``, loaded again when sink maintenance removed a log file the load
    had listed (module docstring). :class:`TableNotFoundError` and every other error are raised as
    they come."""
    for attempt in range(1, LOAD_ATTEMPTS + 1):
        try:
            return DeltaTable(path, version=version)
        except DeltaError as e:
            if attempt == LOAD_ATTEMPTS or not log_file_vanished(e):
                raise
            _log.info("%s: a log file vanished under the load (%s); loading again", path, e)
            time.sleep(0.05 * attempt)
    raise AssertionError("unreachable")


def table_history(table: DeltaTable, limit: int | None = None) -> list[dict]:
    """``table.history(limit)`` with each commit's own version (module docstring, "A history numbered
    right"); ``table`` is read forward to the version the history starts at (newest first, so the
    first entry is the commit of ``table.version()``). A table that moved under every one of
    :data:`HISTORY_ATTEMPTS` reads raises :class:`RuntimeError`."""
    for _ in range(HISTORY_ATTEMPTS):
        version = table.version()
        history = table.history(limit)
        table.update_incremental()
        if table.version() == version:  # nothing newer existed when the commits were listed
            return history
    raise RuntimeError(f"{table.table_uri}: a commit landed during each of {HISTORY_ATTEMPTS} reads of "
                       "the history; read it again")


class TableCache:
    """A sink's table kept between its commits and read forward, not loaded again for each.

    :meth:`get` returns the table at its latest version: the one kept, read forward (delta-rs
    ``update_incremental``: only the commits since), else loaded (:func:`load_table`), or
    ``None`` when there is no table yet. A load reads the checkpoint and every commit after it:
    py-spy on a driver at 20K events/s (200 ms trigger) had it at half of each commit. A read
    forward that fails (maintenance trimmed the commits it needs) loads anew. :meth:`forget`
    after a failed commit: the next attempt starts from a fresh load, as before the cache.
    """

    def __init__(self, path: str):
        self.path = path
        self._table: DeltaTable | None = None

    def get(self) -> DeltaTable | None:
        if self._table is not None:
            try:
                self._table.update_incremental()
                return self._table
            except DeltaError as e:
                _log.info("%s: cannot read the table forward (%s); loading it again", self.path, e)
                self._table = None
        try:
            self._table = load_table(self.path)
        except TableNotFoundError:
            return None
        return self._table

    def forget(self) -> None:
        self._table = None
