"""The ``isb-files`` Spark data source: a landing folder of JSON-lines files as a stream.

Usage (``spark.dataSource.register(FilesDataSource)`` once per session)::

    spark.readStream.format("isb-files")
        .option("path", "/data/landing/logs")      # absolute; visible to every executor
        .option("pattern", "*.jsonl")              # default
        .option("readMaxRows", "100000")           # default read limit per micro-batch
        .option("maxLineBytes", "1048576")         # default longest line read
        .load()                                    # value STRING, _isb_id STRING, _isb_error STRING

Each line is one event: ``value`` holds it for ``from_json`` (as the
``jetstream`` source's events mode does), ``_isb_id`` is
``files/<file name>/<line number>`` (lines counted from 1). ``_isb_error`` is
null, or why the line cannot be an event: a line that is not UTF-8 (``value``
holds it with the bad bytes as ``\\xNN``), or one longer than ``maxLineBytes``
(never read whole: ``value`` holds its first bytes, at most 1 KiB). The source step sends such a
line to the dead-letter buffer with that reason and reads on.

The source reads only inside its folder, and only what was landed there:

- only **regular files** directly in the folder are listed; a symlink, FIFO,
  device or sub-folder is never opened (it is logged once and skipped);
- a file is opened relative to the folder with ``O_NOFOLLOW | O_NONBLOCK`` and
  checked to be a regular file once open, so a name swapped for a symlink or a
  FIFO after it was listed fails the task (a landed file must not change)
  rather than reading elsewhere or blocking;
- reads are bounded: files are counted and read a buffer at a time, a line
  longer than ``maxLineBytes`` is skipped to its end, and a task's Arrow batch
  holds at most ``_BATCH_BYTES`` of values.

Which folder a spec may name is :func:`landing_folder`'s rule: under the data
dir, or under a folder of ``ISBFLOW_LANDING_DIRS``.

The landing protocol (what makes the source replayable):

- a file is **immutable once landed**: producers write ``name.jsonl.tmp`` and
  rename it to ``name.jsonl`` when complete (:func:`land` does exactly that);
  names not matching ``pattern`` (``*.tmp``, hidden files) are never read;
- files are read in **name order**, and a new file must sort after every file
  already landed (e.g. ``<UTC timestamp>-<producer>.jsonl``): a file landing
  with a name before the current position is never read;
- files stay until every range naming them is committed downstream (a replay
  reads them again).

Offsets are a position in that order: ``{"file": F, "line": n}`` means "every
line of every file named before F, and the first n lines of F" (the initial
offset is ``{"file": "", "line": 0}``). A batch (start, end] reads exactly the
lines between two positions, so reading a range twice gives the same records.
Lines are ``\\n``-terminated; a final line without ``\\n`` counts (the file is
complete once renamed). A blank line is a record with an empty ``value``, so the
parse step sends it to the dead-letter buffer like any malformed line and
line numbers stay those an editor shows.
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StringType, StructField, StructType

log = logging.getLogger(__name__)

#: the column holding why a line cannot be an event (null for a good line): the source step's error column
ERROR_COLUMN = "_isb_error"
FILES_SCHEMA = StructType([StructField("value", StringType()), StructField("_isb_id", StringType()),
                           StructField(ERROR_COLUMN, StringType())])
_ARROW_SCHEMA = pa.schema([("value", pa.string()), ("_isb_id", pa.string()), (ERROR_COLUMN, pa.string())])
DEFAULT_READ_MAX_ROWS = 100_000
DEFAULT_ROWS_PER_PARTITION = 50_000
#: the longest line read (bytes, without its newline); a longer one is dead-lettered, never read whole
DEFAULT_MAX_LINE_BYTES = 1024 * 1024
_ROWS_PER_BATCH = 50_000  # Arrow batch size yielded by read()
_BATCH_BYTES = 64 * 1024 * 1024  # ... and at most this many bytes of values
_READ_BUFFER = 1024 * 1024  # bytes read at a time
_LONG_LINE_KEPT = 1024  # bytes of an over-long line kept in its value (at most maxLineBytes)
ID_PREFIX = "files"
#: more folders a files source may read from, besides the data dir (``os.pathsep``-separated)
LANDING_DIRS_ENV = "ISBFLOW_LANDING_DIRS"


class FilesSourceError(Exception):
    """The landing folder broke the protocol (a file in a range changed or vanished) or an option is bad."""


@dataclass(frozen=True, order=True)
class Position:
    """A point in the (file name, line) order: every line before it has been read."""

    file: str = ""
    line: int = 0

    def to_json(self) -> dict:
        return {"file": self.file, "line": self.line}

    @classmethod
    def from_json(cls, d: dict) -> Position:
        try:
            return cls(str(d["file"]), int(d["line"]))
        except (KeyError, TypeError, ValueError):
            raise FilesSourceError(f"isb-files: not an offset of this source: {d!r} "
                                   "(expected {\"file\": name, \"line\": n})") from None


@dataclass
class FileSegment(InputPartition):
    """Lines ``[lo, hi)`` (0-based) of one file: one Spark task (picklable)."""

    path: str
    name: str
    lo: int
    hi: int
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES


def land(folder: str | os.PathLike, name: str, lines: Iterable[str | bytes]) -> Path:
    """Write a complete file into a landing folder the safe way: ``name.tmp``, then rename."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final, tmp = folder / name, folder / f"{name}.tmp"
    with open(tmp, "wb") as f:
        for line in lines:
            data = line.encode() if isinstance(line, str) else line
            f.write(data if data.endswith(b"\n") else data + b"\n")
    os.replace(tmp, final)
    return final


def landing_folder(path: str, data_dir: str | os.PathLike) -> Path:
    """The folder a files source with spec ``path`` reads: a relative path under ``data_dir``; an
    absolute one only when it lies (symlinks resolved) under the data dir or a folder of
    ``ISBFLOW_LANDING_DIRS``. :class:`FilesSourceError` naming the field otherwise: a spec must not
    read a folder of this host that nobody set aside for landing files."""
    folder = Path(path) if os.path.isabs(path) else Path(data_dir) / path
    roots = [Path(data_dir)] + [Path(r) for r in os.environ.get(LANDING_DIRS_ENV, "").split(os.pathsep) if r]
    real = os.path.realpath(folder)
    for root in roots:
        top = os.path.realpath(root)
        if real == top or real.startswith(top.rstrip(os.sep) + os.sep):
            return folder
    allowed = ", ".join(str(r) for r in roots)
    raise FilesSourceError(
        f"source.files.path {path!r} is outside the folders a files source may read ({allowed}): land the "
        f"files under the data dir (a relative path), or add their folder to {LANDING_DIRS_ENV}")


def _not_regular(path: str, st: os.stat_result) -> FilesSourceError:
    kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode)
            else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device")
    return FilesSourceError(f"isb-files: {path} is {kind}, not a regular file: only files landed in the "
                            "folder are read (write NAME.tmp and rename it when complete)")


def open_landed(folder: str | os.PathLike, name: str) -> int:
    """A read-only fd of the regular file ``name`` directly in ``folder``: opened relative to the folder
    with ``O_NOFOLLOW | O_NONBLOCK`` (a symlink is refused, a FIFO never blocks) and checked with
    ``fstat``. :class:`FilesSourceError` for a symlink or anything but a regular file;
    ``FileNotFoundError`` when it is gone."""
    path = os.path.join(folder, name)
    if not name or name in (".", "..") or "/" in name or os.sep in name:
        raise FilesSourceError(f"isb-files: {name!r} is not a file name in {folder}")
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise FilesSourceError(f"isb-files: {path} is a symlink: only files landed in the folder are "
                                       "read, never what a link points to") from None
            raise
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def count_lines(path: str | os.PathLike) -> int:
    """Lines of the landed file ``path`` (a final line without ``\\n`` counts), read a buffer at a time."""
    folder, name = os.path.split(os.fspath(path))
    fd = open_landed(folder or ".", name)
    n, last = 0, b"\n"
    try:
        while chunk := os.read(fd, _READ_BUFFER):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    finally:
        os.close(fd)
    return n + (last != b"\n")


def landed(path: str | os.PathLike, pattern: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The files landed in the folder ``path`` in name order (regular files matching ``pattern``,
    neither hidden nor ``*.tmp``), and the matching names that are not read with what they are."""
    try:
        with os.scandir(path) as entries:
            matching = [e for e in entries if fnmatch.fnmatchcase(e.name, pattern)
                        and not e.name.startswith(".") and not e.name.endswith(".tmp")]
    except FileNotFoundError:
        return [], []
    names = [e.name for e in matching if e.is_file(follow_symlinks=False)]
    others = [(e.name, "a symlink" if e.is_symlink() else "not a regular file")
              for e in matching if not e.is_file(follow_symlinks=False)]
    return sorted(names), others


def landed_lines(path: str | os.PathLike, pattern: str) -> dict[str, int]:
    """``files/<name>`` (the partition of the ids read from it) -> its line count, for every file
    landed in ``path``: what a replay of the source reads, and recovery checks the sinks against."""
    return {f"{ID_PREFIX}/{name}": count_lines(os.path.join(path, name)) for name in landed(path, pattern)[0]}


def _lines(f, max_line_bytes: int) -> Iterator[tuple[bytes, int | None]]:
    """Each line of ``f`` (without its ``\\n``) and None, or for a line over ``max_line_bytes`` its first
    bytes and its length: such a line is skipped to its end a buffer at a time, never held whole."""
    while line := f.readline(max_line_bytes + 1):
        if line.endswith(b"\n"):
            yield line[:-1], None
            continue
        if len(line) <= max_line_bytes:  # the last line, without a newline
            yield line, None
            continue
        size, head = len(line), line[:min(_LONG_LINE_KEPT, max_line_bytes)]
        while (more := f.readline(_READ_BUFFER)) and not more.endswith(b"\n"):
            size += len(more)
        size += max(0, len(more) - 1)
        yield head, size


def _ids(name: str, lo: int, hi: int) -> pa.Array:
    """``files/<name>/<line>`` for lines lo+1 .. hi (1-based)."""
    numbers = pc.cast(pa.array(range(lo + 1, hi + 1), pa.int64()), pa.string())
    return pc.binary_join_element_wise(pa.scalar(f"{ID_PREFIX}/{name}/"), numbers, "")


def _event(name: str, number: int, line: bytes, size: int | None, max_line_bytes: int) -> tuple[str, str | None]:
    """A line's ``value`` and ``_isb_error`` (module docstring)."""
    where = f"line {number} of landed file {name}"
    if size is not None:
        return (line.decode(errors="backslashreplace"),
                f"{where} is {size} bytes, over the files source's maxLineBytes ({max_line_bytes}): not read "
                f"(its first {len(line)} bytes are kept)")
    try:
        return line.decode(), None
    except UnicodeDecodeError as e:
        return (line.decode(errors="backslashreplace"),
                f"{where} is not UTF-8 (byte 0x{line[e.start]:02x} at offset {e.start}): events are UTF-8 JSON")


def read_segment(seg: FileSegment, rows_per_batch: int = _ROWS_PER_BATCH,
                 batch_bytes: int = _BATCH_BYTES) -> Iterator[pa.RecordBatch]:
    """The records of one segment as Arrow batches (at most ``rows_per_batch`` rows, about
    ``batch_bytes`` of values); :class:`FilesSourceError` if the file broke the protocol."""
    path = os.path.join(seg.path, seg.name)
    try:
        fd = open_landed(seg.path, seg.name)
    except FileNotFoundError:
        raise FilesSourceError(
            f"isb-files: {path} is gone but lines {seg.lo + 1}-{seg.hi} are still to be read: keep landed "
            "files until the pipeline has committed them downstream") from None
    values: list[str] = []
    errors: list[str | None] = []
    held, first, number = 0, seg.lo, 0

    def batch() -> pa.RecordBatch:
        return pa.RecordBatch.from_arrays(
            [pa.array(values, pa.string()), _ids(seg.name, first, first + len(values)), pa.array(errors, pa.string())],
            schema=_ARROW_SCHEMA)

    with os.fdopen(fd, "rb", buffering=_READ_BUFFER) as f:
        for number, (line, size) in enumerate(_lines(f, seg.max_line_bytes), start=1):
            if number <= seg.lo:
                continue
            value, error = _event(seg.name, number, line, size, seg.max_line_bytes)
            values.append(value)
            errors.append(error)
            held += len(line)
            if len(values) >= rows_per_batch or held >= batch_bytes:
                yield batch()
                first, held = first + len(values), 0
                values, errors = [], []
            if number >= seg.hi:
                break
    if number < seg.hi:
        raise FilesSourceError(
            f"isb-files: {path} has {number} lines but line {seg.hi} was counted before: a landed file "
            "must not change (write NAME.tmp and rename it when complete)")
    if values:
        yield batch()


class FilesStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets and planning run on the driver; :meth:`read` runs in executor tasks."""

    def __init__(self, path: str, pattern: str, read_max_rows: int, rows_per_partition: int,
                 max_line_bytes: int = DEFAULT_MAX_LINE_BYTES):
        self.path, self.pattern = path, pattern
        self.read_max_rows, self.rows_per_partition = read_max_rows, rows_per_partition
        self.max_line_bytes = max_line_bytes
        self._counts: dict[str, int] = {}  # driver only: line counts of landed (immutable) files
        self._skipped: set[str] = set()  # driver only: names not read (not regular files), logged once
        self._target: Position | None = None  # availableNow: nothing after this

    # -- driver ------------------------------------------------------------------

    def _listing(self) -> list[str]:
        """The landed files, in name order: regular files matching the pattern (module docstring)."""
        names, others = landed(self.path, self.pattern)
        for name, what in others:
            if name not in self._skipped:
                self._skipped.add(name)
                log.warning("isb-files: %s is %s: not read (only files landed in %s are)",
                            os.path.join(self.path, name), what, self.path)
        return names

    def _lines(self, name: str) -> int:
        if name not in self._counts:
            self._counts[name] = count_lines(os.path.join(self.path, name))
        return self._counts[name]

    def _end(self) -> Position:
        names = self._listing()
        return Position(names[-1], self._lines(names[-1])) if names else Position()

    def _segments(self, start: Position, end: Position) -> Iterator[tuple[str, int, int]]:
        """(name, lo, hi) of every file part between two positions, in order."""
        for name in self._listing():
            if name < start.file or name > end.file:
                continue
            lo = start.line if name == start.file else 0
            hi = end.line if name == end.file else self._lines(name)
            if hi > lo:
                yield name, lo, hi

    def initialOffset(self) -> dict:
        return Position().to_json()

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.read_max_rows)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._end()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        begin = Position.from_json(start)
        last = self._target if self._target is not None else self._end()
        if last <= begin:
            return begin.to_json()
        budget = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        if not isinstance(limit, ReadMaxRows | ReadAllAvailable):
            budget = self.read_max_rows
        end = begin
        for name, lo, hi in self._segments(begin, last):
            take = hi - lo if budget is None else min(hi - lo, budget)
            end = Position(name, lo + take)
            if budget is not None:
                budget -= take
                if budget <= 0:
                    break
        return end.to_json()

    def reportLatestOffset(self) -> dict:
        return self._end().to_json()

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        out: list[InputPartition] = []
        for name, lo, hi in self._segments(Position.from_json(start), Position.from_json(end)):
            for a in range(lo, hi, self.rows_per_partition):
                out.append(FileSegment(self.path, name, a, min(a + self.rows_per_partition, hi),
                                       self.max_line_bytes))
        return out

    def commit(self, end: dict) -> None:
        # Not an acknowledgement (steps acknowledge nothing): forget line counts of files wholly before `end`.
        pos = Position.from_json(end)
        for name in [n for n in self._counts if n < pos.file]:
            del self._counts[name]

    # -- executor ----------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, FileSegment)
        yield from read_segment(partition)


def _positive_int(options: dict, name: str, default: int) -> int:
    raw = options.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise FilesSourceError(f"format('isb-files'): option {name}={raw!r} must be a positive integer")
    return value


class FilesDataSource(DataSource):
    """``spark.readStream.format("isb-files")``: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return "isb-files"

    def schema(self) -> StructType:
        return FILES_SCHEMA

    def streamReader(self, schema: StructType) -> FilesStreamReader:
        path = self.options.get("path")
        if not path:
            raise FilesSourceError("format('isb-files') needs option path: the landing folder "
                                   "(absolute, visible to every executor)")
        return FilesStreamReader(
            path=os.path.abspath(path),
            pattern=self.options.get("pattern") or "*.jsonl",
            read_max_rows=_positive_int(self.options, "readMaxRows", DEFAULT_READ_MAX_ROWS),
            rows_per_partition=_positive_int(self.options, "rowsPerPartition", DEFAULT_ROWS_PER_PARTITION),
            max_line_bytes=_positive_int(self.options, "maxLineBytes", DEFAULT_MAX_LINE_BYTES),
        )
