"""Local Delta tables, loaded while their log is being bounded.

Loading a Delta table (delta-rs ``DeltaTable(path)``) reads ``_last_checkpoint``,
lists ``_delta_log`` and then reads the checkpoint and the commits after it.
Sink maintenance (``isbflow sink maintain``, :func:`isbflow.sinks.delta_log.trim_log`)
writes a new checkpoint and removes the log files and the checkpoint before it.
A load that listed the log before the removal then fails on a file that was
there a moment ago: "File not found: .../_delta_log/...json", "Object at location
.../...checkpoint.parquet not found", "Invalid table version: 4" (measured: 35 of
661 loads failed while a writer checkpointed and cleaned every 5 commits). Nothing is lost: the table is whole at its new checkpoint, so
:func:`load_table` loads again, which lists the log anew.

A version that really is gone (time travel past the log's retention) fails the
same way on every attempt and is raised after :data:`LOAD_ATTEMPTS`.

**A history numbered right** (:func:`table_history`). delta-rs 1.6's
``DeltaTable.history()`` lists the commits the log holds *when it is asked* and
numbers them down from the version the table was *loaded* at: a commit that lands
between the load and the call is listed as the loaded version, and every older one
one below its own. Beside a running sink that happens: a quality check reading the
raw table at one version would find the next commit's offsets under that version's
label, and report that batch's records missing (measured: of 100 loads and
``history(3)`` beside a thread appending commits, 56 had wrong labels).
:func:`table_history` reads the commit files of the table's own versions
(``_delta_log/<version>.json``, each one's ``commitInfo``, what delta-rs returns):
the file name is the version, and nothing newer than the table is read (asking
again until the table stops moving would not do: a busy sink's table need never stop).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse
from urllib.request import url2pathname

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError, TableNotFoundError
from deltalake.transaction import AddAction

from isbflow.local import delta_sidecar

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
    """The ``_delta_log`` folder of a local table."""
    return Path(url2pathname(urlparse(table.table_uri).path)) / "_delta_log"


def commit_action(root: Path, version: int, kind: str) -> dict | None:
    """The first ``kind`` action (``commitInfo``, ``txn``, ...) of commit ``version``'s file in the
    log folder ``root``; ``None`` when it holds none; :class:`FileNotFoundError` when the file is gone.
    Only the lines that name ``kind`` are parsed (a commit of many files has as many ``add`` lines)."""
    tag = f'"{kind}"'.encode()
    with open(root / commit_file(version), "rb") as f:
        for line in f:
            if tag in line and kind in (action := json.loads(line)):
                return action[kind]
    return None


def table_history(table: DeltaTable, limit: int | None = None) -> list[dict]:
    """The commits of ``table`` up to its version, newest first (``limit``: at most that many), as
    ``DeltaTable.history`` gives them but each with its own ``version`` (module docstring). A commit
    file the log no longer holds (maintenance removed it, or is removing it now) is left out, as
    delta-rs leaves it out. A fold's metadata kept beside the log is read back in
    (:mod:`isbflow.local.delta_sidecar`)."""
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
        out.append(delta_sidecar.expand(root.parent, {**info, "version": v}))
    return out


class TableCache:
    """A sink's table kept between its commits and read forward, not loaded again for each.

    :meth:`get` returns the table at its latest version: the one kept, read forward (delta-rs
    ``update_incremental``: only the commits since), else loaded (:func:`load_table`), or
    ``None`` when there is no table yet. A load reads the checkpoint and every commit after it:
    py-spy on a driver at 20K events/s (200 ms trigger) had it at half of each commit. A read
    forward that fails (maintenance trimmed the commits it needs) loads anew. :meth:`forget`
    after a failed commit: the next attempt starts from a fresh load, as before the cache.

    **Appends without listing the log** (:meth:`kept`, :meth:`append`). Every read forward and every
    delta-rs commit lists the whole ``_delta_log`` folder on a local disk (object_store's
    ``list_with_offset`` reads every entry and filters: delta-kernel-rs issue 2335), so a sink's
    commit costs CPU in proportion to the log it keeps: ``bench/delta_log.py`` measured a delta-rs
    append 20.1 ms with 205 log entries and 434 ms with 140,105 (~2.95 us an entry; a commit every
    5 s kept 168 h is ~121,000 entries), one through this cache 0.6-2.2 ms with any of those logs.
    A plain append needs none of it: the commit is the next version's
    file, and nothing but this cache's own appends can have come since the kept table when that
    file is absent and the log's last checkpoint is not past the kept version (sink maintenance
    trims the commit files below a checkpoint it wrote: a commit written into such a hole would
    be read by nobody). :meth:`kept` answers from the kept table and the appends made since (a ``stat``
    and ``_last_checkpoint``; an unreadable hint: no shortcut), :meth:`append` writes the next commit
    file itself (written aside, then linked into place: a version another writer took is never
    overwritten, and the caller falls back to delta-rs). Before the link the log must reach the
    version before (its commit file or its checkpoint: never a commit after a gap); after it, a
    checkpoint at or past the version is read for the commit's app transaction: one written on top
    of the commit keeps it (a published commit is never removed), one written before it by a trim
    that raced the link takes it back (it lies below the checkpoint, unread) and delta-rs commits.
    A file system without hard links falls back the same way; asides a crashed writer left are
    removed at the first load. Every :data:`DEFAULT_CHECKPOINT_INTERVAL` versions (the table's
    ``delta.checkpointInterval``) reads forward and writes the checkpoint delta-rs' post-commit hook
    would have. Only for tables whose protocol asks nothing more of a writer than appending files
    (writer version 2 at most, no table features, no constraints or invariants); an upsert's removes
    also not for a ``delta.appendOnly`` table (:meth:`removes_plainly`).

    **An upsert's commit** (:meth:`commit`, :meth:`files`) the same way: removes as well as adds, and
    the table's active files with their stats kept current across the commits it makes, so an upsert
    sink chooses the files it rewrites without a delta-rs merge (:mod:`isbflow.sinks.delta_upsert`).
    """

    def __init__(self, path: str):
        self.path = path
        self._table: DeltaTable | None = None
        #: the app transactions ``(app id, version)`` of the versions :meth:`commit` wrote after the
        #: kept table's own, oldest first
        self._ahead: list[tuple[str, int]] = []
        #: :func:`appends_plainly` of the kept table, at the version it was asked
        self._plain: tuple[int, bool] | None = None
        #: the active files with their stats (:meth:`files`) and the version they are the files of
        #: (the kept table's, then each :meth:`commit`'s); ``None`` until asked
        self._files: tuple[int, dict[str, FileStats]] | None = None
        #: the file system links a commit file into place (``os.link``); else every commit is delta-rs'
        self._links = True
        #: the log's stale asides have been removed (:func:`remove_stale_asides`, at the first load)
        self._swept = False

    def get(self) -> DeltaTable | None:
        self._ahead.clear()
        self._files = None
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
        if not self._swept:
            remove_stale_asides(log_root(self._table))
            self._swept = True
        return self._table

    def kept(self, app_id: str, appending: bool = True) -> tuple[DeltaTable, int, int | None] | None:
        """Without listing the log: the kept table, the table's latest version and ``app_id``'s
        transaction version in it, when every commit since the kept table's is one :meth:`append`
        made (the next version's file is absent and no checkpoint is past that version) and,
        ``appending``, the table takes plain appends; else ``None`` (read it forward with
        :meth:`get`). Not ``appending`` (a delta-rs merge that moves the kept table to the version
        it commits), the kept table is current on the same two conditions."""
        table = self._table
        if table is None:
            return None
        if appending and not self.plain():
            return None
        version = table.version() + len(self._ahead)
        root = log_root(table)
        # the checkpoint read after the next version's file: a trim removes commit files only below a
        # checkpoint it wrote first, so a version absent under a checkpoint past it had been there
        checkpoint = last_checkpoint(root)  # None: unreadable, so no shortcut (fail closed)
        if (root / commit_file(version + 1)).exists() or checkpoint is None or checkpoint > version:
            return None
        txn = next((v for a, v in reversed(self._ahead) if a == app_id), None)
        return table, version, txn if txn is not None else table.transaction_version(app_id)

    def ahead(self) -> int:
        """How many versions :meth:`commit` wrote past the kept table (which delta-rs must not commit
        on until :meth:`get` reads it forward)."""
        return len(self._ahead)

    def plain(self) -> bool:
        """:func:`appends_plainly` of the kept table (asked once a version); ``False`` without one."""
        table = self._table
        if table is None or not self._links:
            return False
        if self._plain is None or self._plain[0] != table.version():
            self._plain = (table.version(), appends_plainly(table))
        return self._plain[1]

    def removes_plainly(self) -> bool:
        """:meth:`plain`, and the table takes ``remove`` actions that change data (it is not
        ``delta.appendOnly``): what an upsert's own commit writes."""
        return self.plain() and not append_only(self._table)

    def files(self) -> dict[str, FileStats]:
        """The table's active files with their stats, from the kept table (read forward first when
        commits were made since that did not say what they added) and the commits :meth:`commit`
        made since; the caller must not change it."""
        table = self._table
        latest = None if table is None else table.version() + len(self._ahead)
        if self._files is None or self._files[0] != latest:  # built for another version: a delta-rs
            if self._ahead:                                    # commit moved the kept table since
                table = self.get()
            if table is None:
                raise TableNotFoundError(f"no Delta table at {self.path}")
            self._files = (table.version(), file_stats(table))
        return self._files[1]

    def append(self, actions: Sequence[AddAction], metadata: Mapping[str, Any], app_id: str, txn_version: int,
               partition_by: Sequence[str]) -> int | None:
        """Commit ``actions`` as the version after :meth:`kept`'s, with the app transaction ``(app_id,
        txn_version)`` and ``metadata`` in its ``commitInfo`` (as delta-rs writes them); the version,
        or ``None`` when another writer committed it first (nothing written)."""
        return self.commit(actions, (), metadata, app_id, txn_version,
                           {"mode": "Append", "partitionBy": json.dumps(list(partition_by))})

    def commit(self, actions: Sequence[AddAction], removes: Sequence[tuple[str, int]], metadata: Mapping[str, Any],
               app_id: str, txn_version: int, parameters: Mapping[str, str], operation: str = "WRITE",
               stats: Mapping[str, FileStats] | None = None) -> int | None:
        """:meth:`append` with ``removes`` too (``(path, size)`` of active files of an unpartitioned
        table, :meth:`files`), ``operation`` and its ``parameters`` in the ``commitInfo``; ``stats``:
        the added files' (:meth:`files` then follows the commit; without, the next call reads the
        table forward)."""
        assert self._table is not None, "commit() after kept()"
        root = log_root(self._table)
        version = self._table.version() + len(self._ahead) + 1
        now = int(time.time() * 1000)
        info = {"timestamp": now, "operation": operation, "operationParameters": dict(parameters),
                "engineInfo": ENGINE, "clientVersion": ENGINE, **metadata}
        lines = [{"commitInfo": info}]
        lines += [{"add": {"path": quote(a.path, safe="/="), "partitionValues": dict(a.partition_values),
                           "size": a.size, "modificationTime": a.modification_time, "dataChange": a.data_change,
                           "stats": a.stats}} for a in actions]
        lines += [{"remove": {"path": quote(path, safe="/="), "dataChange": True, "deletionTimestamp": now,
                              "extendedFileMetadata": True, "partitionValues": {}, "size": size}}
                  for path, size in removes]
        lines.append({"txn": {"appId": app_id, "version": txn_version}})
        try:
            text = "".join(json.dumps(line, separators=(",", ":"), allow_nan=False, ensure_ascii=False) + "\n"
                           for line in lines)
        except ValueError as e:
            raise ValueError(f"{self.path}: a commit's metadata holds a number JSON cannot carry "
                             f"(NaN or Infinity): {e}") from None
        # The log must reach the version before: its commit file, or a checkpoint of it. Maintenance
        # trims commit files only below a checkpoint it wrote, and a checkpoint is written only of
        # versions that exist, so a version linked on a log that reaches the one before is read by
        # every reader; on a log that does not (trimmed past it, or a table made again under the
        # sink) it would be a file below a checkpoint, or after a gap, and delta-rs commits instead.
        if version > 0 and not log_reaches(root, version - 1):
            return None
        aside = root / f".{commit_file(version)}.{uuid.uuid4().hex}.tmp"
        aside.write_text(text, encoding="utf-8")
        try:
            os.link(aside, root / commit_file(version))  # fails when the version exists: never overwrites
        except (FileExistsError, FileNotFoundError):
            return None
        except OSError as e:  # no hard links on this file system: delta-rs commits from now on
            _log.info("%s: the file system links no commit file into place (%s); committing through "
                      "delta-rs", self.path, e)
            self._links = False
            return None
        finally:
            aside.unlink(missing_ok=True)
        # A checkpoint at or past this version now: written on top of this commit (it holds the app
        # transaction: the commit is published and stays), or before it, by maintenance that trimmed
        # the log between the look above and the link (this file lies below it, unread: taken back).
        checkpoint = last_checkpoint(root)
        if checkpoint is not None and checkpoint >= version and not checkpoint_holds(root, checkpoint, app_id,
                                                                                      txn_version):
            (root / commit_file(version)).unlink(missing_ok=True)
            return None
        self._ahead.append((app_id, txn_version))
        if self._files is not None and stats is not None and self._files[0] == version - 1:
            for path, _ in removes:
                self._files[1].pop(path, None)
            self._files[1].update(stats)
            self._files = (version, self._files[1])
        if version % checkpoint_interval(self._table) == 0:
            self._checkpoint()
        return version

    def _checkpoint(self) -> None:
        """The checkpoint delta-rs writes after every ``delta.checkpointInterval`` commits; the
        commit it follows has landed, so a failure is logged, not raised."""
        try:
            table = self.get()
            if table is not None:
                table.create_checkpoint()
        except DeltaError as e:
            _log.warning("%s: checkpoint not written (%s); the next one covers it", self.path, e)
            self.forget()

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
        self._ahead.clear()
        self._files = None


@dataclass(frozen=True)
class FileStats:
    """An active file of a table, as an upsert chooses the files it reads (:meth:`TableCache.files`):
    its size, rows, and per column the least and greatest value and the nulls (absent: unknown)."""

    size: int
    rows: int | None
    mins: Mapping[str, Any]
    maxs: Mapping[str, Any]
    nulls: Mapping[str, int]


def file_stats(table: DeltaTable) -> dict[str, FileStats]:
    """Every active file of ``table`` by its path, with the stats its add action holds."""
    actions = pa.table(table.get_add_actions(flatten=True)).to_pydict()
    out = {}
    for i, path in enumerate(actions["path"]):
        per = {kind: {name.split(".", 1)[1]: values[i] for name, values in actions.items()
                      if name.startswith(f"{kind}.") and values[i] is not None}
               for kind in ("min", "max", "null_count")}
        rows = actions.get("num_records", [None] * len(actions["path"]))[i]
        out[path] = FileStats(actions["size_bytes"][i], rows, per["min"], per["max"], per["null_count"])
    return out


#: ``engineInfo`` and ``clientVersion`` of the commits :meth:`TableCache.append` writes
ENGINE = "isbflow"
#: delta-rs' (and Delta's) checkpoint interval when the table does not set ``delta.checkpointInterval``
DEFAULT_CHECKPOINT_INTERVAL = 100


def commit_file(version: int) -> str:
    """The name of commit ``version``'s file in ``_delta_log``."""
    return f"{version:020d}.json"


def last_checkpoint(root: Path) -> int | None:
    """The version of the log's last checkpoint (``_delta_log/_last_checkpoint``): -1 when the log
    has no such hint, ``None`` when it has one that cannot be read (being replaced, or damaged): a
    caller then takes no shortcut on it."""
    try:
        return int(json.loads((root / "_last_checkpoint").read_text())["version"])
    except FileNotFoundError:
        return -1
    except (OSError, ValueError, KeyError, TypeError):
        return None


def log_reaches(root: Path, version: int) -> bool:
    """Whether the log in ``root`` holds ``version``: its commit file, or a checkpoint of it (a
    single-part one, or the parts ``_last_checkpoint`` names). Looks up names; never lists the log."""
    if (root / commit_file(version)).exists() or (root / f"{version:020d}.checkpoint.parquet").exists():
        return True
    try:
        hint = json.loads((root / "_last_checkpoint").read_text())
        parts = int(hint.get("parts") or 0)
        return int(hint["version"]) == version and parts > 0 and (
            root / f"{version:020d}.checkpoint.{1:010d}.{parts:010d}.parquet").exists()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def checkpoint_holds(root: Path, version: int, app_id: str, txn_version: int) -> bool:
    """Whether checkpoint ``version`` of the log in ``root`` holds ``app_id``'s transaction at
    ``txn_version`` or later; ``True`` when the checkpoint cannot be read (gone: a later one
    replaced it), so that a published commit is never taken back on a guess."""
    hint = {}
    try:
        hint = json.loads((root / "_last_checkpoint").read_text())
    except (OSError, ValueError):
        pass
    parts = int(hint.get("parts") or 0) if hint.get("version") == version else 0
    names = ([f"{version:020d}.checkpoint.{i:010d}.{parts:010d}.parquet" for i in range(1, parts + 1)] if parts
             else [f"{version:020d}.checkpoint.parquet"])
    try:
        txns = [t for n in names for t in pq.read_table(root / n, columns=["txn"]).column("txn").to_pylist() if t]
    except (OSError, pa.ArrowException) as e:
        _log.warning("%s: checkpoint %d cannot be read (%s); the commit below it is kept", root, version, e)
        return True
    return any(t["appId"] == app_id and t["version"] >= txn_version for t in txns)


#: a commit file written aside before it is linked into place (:meth:`TableCache.commit`)
_ASIDE = re.compile(r"^\.\d{20}\.json\.[0-9a-f]{32}\.tmp$")
#: seconds after which an aside is a crashed writer's: a live one links (and removes) it at once
STALE_ASIDE_S = 60.0


def remove_stale_asides(root: Path) -> int:
    """Remove the commit files a crashed writer left aside in the log folder ``root`` (older than
    :data:`STALE_ASIDE_S`); the number removed. Lists the log: once per sink, when it first loads."""
    removed = 0
    horizon = time.time() - STALE_ASIDE_S
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return 0
    for e in entries:
        if _ASIDE.match(e.name):
            try:
                if e.stat().st_mtime < horizon:
                    os.unlink(e.path)
                    removed += 1
            except FileNotFoundError:
                pass
    if removed:
        _log.info("%s: removed %d commit file(s) a crashed writer left aside", root, removed)
    return removed


def append_only(table: DeltaTable) -> bool:
    """The table is ``delta.appendOnly``: no commit may remove a file that changes data."""
    return table.metadata().configuration.get("delta.appendOnly", "false").strip().lower() == "true"


def checkpoint_interval(table: DeltaTable) -> int:
    raw = table.metadata().configuration.get("delta.checkpointInterval")
    try:
        return max(1, int(raw)) if raw else DEFAULT_CHECKPOINT_INTERVAL
    except ValueError:
        return DEFAULT_CHECKPOINT_INTERVAL


def appends_plainly(table: DeltaTable) -> bool:
    """Whether a commit of ``add`` actions is all a writer owes ``table`` (:class:`TableCache`): a
    local table, writer version 2 at most, no table features, no CHECK constraints, no invariants."""
    protocol = table.protocol()
    return (urlparse(table.table_uri).scheme in ("", "file") and protocol.min_writer_version <= 2
            and not protocol.writer_features
            and not any(k.startswith("delta.constraints.") for k in table.metadata().configuration)
            and "delta.invariants" not in table.schema().to_json())
