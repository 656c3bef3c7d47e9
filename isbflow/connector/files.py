"""The ``isb-files`` Spark data source: a landing folder of JSON-lines files as a stream.

Usage (``spark.dataSource.register(FilesDataSource)`` once per session)::

    spark.readStream.format("isb-files")
        .option("path", "/data/landing/logs")      # absolute; visible to every executor
        .option("pattern", "*.jsonl")              # default
        .option("readMaxRows", "100000")           # default read limit per micro-batch
        .load()                                    # value STRING, _isb_id STRING

Each line is one event: ``value`` holds it for ``from_json`` (as the
``jetstream`` source's events mode does), ``_isb_id`` is
``files/<file name>/<line number>`` (lines counted from 1).

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

import fnmatch
import os
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

FILES_SCHEMA = StructType([StructField("value", StringType()), StructField("_isb_id", StringType())])
_ARROW_SCHEMA = pa.schema([("value", pa.string()), ("_isb_id", pa.string())])
DEFAULT_READ_MAX_ROWS = 100_000
DEFAULT_ROWS_PER_PARTITION = 50_000
_ROWS_PER_BATCH = 50_000  # Arrow batch size yielded by read()
ID_PREFIX = "files"


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


def _split_lines(data: bytes) -> list[bytes]:
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the terminating newline, not an empty last line
    return lines


def count_lines(path: str | os.PathLike) -> int:
    with open(path, "rb") as f:
        data = f.read()
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def _ids(name: str, lo: int, hi: int) -> pa.Array:
    """``files/<name>/<line>`` for lines lo+1 .. hi (1-based)."""
    numbers = pc.cast(pa.array(range(lo + 1, hi + 1), pa.int64()), pa.string())
    return pc.binary_join_element_wise(pa.scalar(f"{ID_PREFIX}/{name}/"), numbers, "")


def read_segment(seg: FileSegment, rows_per_batch: int = _ROWS_PER_BATCH) -> Iterator[pa.RecordBatch]:
    """The records of one segment as Arrow batches; :class:`FilesSourceError` if the file broke the protocol."""
    path = os.path.join(seg.path, seg.name)
    try:
        with open(path, "rb") as f:
            lines = _split_lines(f.read())
    except FileNotFoundError:
        raise FilesSourceError(
            f"isb-files: {path} is gone but lines {seg.lo + 1}-{seg.hi} are still to be read: keep landed "
            "files until the pipeline has committed them downstream") from None
    if len(lines) < seg.hi:
        raise FilesSourceError(
            f"isb-files: {path} has {len(lines)} lines but line {seg.hi} was counted before: a landed file "
            "must not change (write NAME.tmp and rename it when complete)")
    for lo in range(seg.lo, seg.hi, rows_per_batch):
        hi = min(lo + rows_per_batch, seg.hi)
        values = pa.array(lines[lo:hi], pa.binary()).cast(pa.string())
        yield pa.RecordBatch.from_arrays([values, _ids(seg.name, lo, hi)], schema=_ARROW_SCHEMA)


class FilesStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets and planning run on the driver; :meth:`read` runs in executor tasks."""

    def __init__(self, path: str, pattern: str, read_max_rows: int, rows_per_partition: int):
        self.path, self.pattern = path, pattern
        self.read_max_rows, self.rows_per_partition = read_max_rows, rows_per_partition
        self._counts: dict[str, int] = {}  # driver only: line counts of landed (immutable) files
        self._target: Position | None = None  # availableNow: nothing after this

    # -- driver ------------------------------------------------------------------

    def _listing(self) -> list[str]:
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if fnmatch.fnmatchcase(n, self.pattern)
                      and not n.startswith(".") and not n.endswith(".tmp"))

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
                out.append(FileSegment(self.path, name, a, min(a + self.rows_per_partition, hi)))
        return out

    def commit(self, end: dict) -> None:
        # Not an acknowledgement (NOTES.md): forget line counts of files wholly before `end`.
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
        )
