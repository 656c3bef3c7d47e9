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
that batch's records, 537 in CI stop 32, were reported missing; measured here,
100 loads and ``history(3)`` beside a thread appending commits: 56 had wrong labels).
:func:`table_history` reads the commit files of the table's own versions
(``_delta_log/<version>.json``, each one's ``commitInfo``, what delta-rs returns):
the file name is the version, and nothing newer than the table is read. Asking
again until the table stops moving was the first fix; a busy sink with a long log
need never stop moving.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from deltalake import DeltaTable
from deltalake.exceptions import DeltaError, TableNotFoundError

_log = logging.getLogger(__name__)

#: loads tried when a log file vanished under the load (module docstring)
LOAD_ATTEMPTS = 5
#: a commit file of the log: ``<version, 20 digits>.json`` (:func:`table_history`)
_COMMIT_FILE = re.compile(r"^(\d{20})\.json$")


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


def log_root(table: DeltaTable) -> Path:
    """The ``_delta_log`` folder of a table on this machine."""
    return Path(url2pathname(urlparse(table.table_uri).path)) / "_delta_log"


def commit_action(root: Path, version: int, kind: str) -> dict | None:
    """The first ``kind`` action (``commitInfo``, ``txn``, ...) of commit ``version``'s file in the
    log folder ``root``; ``None`` when it holds none; :class:`FileNotFoundError` when the file is gone.
    Only the lines that name ``kind`` are parsed (a commit of many files has as many ``add`` lines)."""
    tag = f'"{kind}"'.encode()
    with open(root / f"{version:020d}.json", "rb") as f:
        for line in f:
            if tag in line and kind in (action := json.loads(line)):
                return action[kind]
    return None


def table_history(table: DeltaTable, limit: int | None = None) -> list[dict]:
    """The commits of ``table`` up to its version, newest first (``limit``: at most that many), as
    ``DeltaTable.history`` gives them but each with its own ``version`` (module docstring). A commit
    file the log no longer holds (maintenance removed it, or is removing it now) is left out, as
    delta-rs leaves it out."""
    root = log_root(table)
    top = table.version()
    versions = sorted((v for f in os.listdir(root) if (m := _COMMIT_FILE.match(f)) and (v := int(m[1])) <= top),
                      reverse=True)
    out: list[dict] = []
    for v in versions:
        if limit is not None and len(out) >= limit:
            break
        try:
            info = commit_action(root, v, "commitInfo") or {}
        except FileNotFoundError:
            continue
        out.append({**info, "version": v})
    return out


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

    def committed_version(self, read: int | None, app_id: str, txn_version: int) -> int:
        """The version a commit made on a table read at version ``read``: ``read + 1`` when that
        commit file holds the commit's app transaction (``app_id`` at ``txn_version``), one small
        file read; else (a commit landed between, or the commit created the table) the table read
        forward. A commit leaves the kept table where it was (delta-rs 1.6), and reading it forward
        lists the whole log: py-spy on the demo's driver had reading forward at 13% of its busy
        Python (two reads a batch), and the next batch reads the table forward anyway."""
        if read is not None and self._table is not None:
            try:
                txn = commit_action(log_root(self._table), read + 1, "txn") or {}
            except FileNotFoundError:
                txn = {}
            if txn.get("appId") == app_id and txn.get("version") == txn_version:
                return read + 1
        table = self.get()
        if table is None:
            raise TableNotFoundError(f"no Delta table at {self.path} after a commit")
        return table.version()

    def forget(self) -> None:
        self._table = None
