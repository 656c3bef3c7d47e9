"""Reference tables: small keyed tables a step joins against (Kafka Streams' GlobalKTable).

A reference table ``name`` of pipeline ``p`` lives in the KV bucket
:func:`isbflow.isb.naming.reference_bucket` ``(p, name)``: one key per row, the
row's other columns as one JSON object. Keys use the KV alphabet
(``A-Z a-z 0-9 - _ = / .``).

- :func:`put` writes rows (creating the bucket when missing) and skips rows whose
  value is unchanged, so re-loading the same file changes nothing, not even the
  revision; ``replace=True`` also deletes keys absent from ``rows``.
- :func:`load` returns ``(revision, table)``: ``revision`` is the bucket stream's
  last sequence, which every put or delete raises (on a store with its own key-value role,
  Redis, a counter every put that changes something raises: :data:`REVISION_KEY`); the table is a
  ``pyarrow.Table`` with the key column first, rows sorted by key. A load that
  does not finish within ``timeout`` seconds (:data:`LOAD_TIMEOUT`) fails with
  a :class:`ReferenceError` naming the bucket, never waits forever.
- Rows are validated on put and on load (:func:`check_rows`): a key in the KV
  alphabet, a value that is a JSON object of scalar columns (string, number,
  boolean or null), a column of one type across rows; a bad row is an error
  naming its key (and, on load, the bucket).
- :class:`ReferenceCache` serves a Spark step: each :meth:`~ReferenceCache.dataframe`
  call (once per micro-batch, on the driver) asks the server for the revision
  only, and reloads the table only when it changed.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Coroutine, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KV_DEL, KV_PURGE

from isbflow.isb import naming
from isbflow.isb.connect import NatsSettings, session
from isbflow.isb.read import read_range, stream_state
from isbflow.isb.store import KeyValue

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

T = TypeVar("T")
_KEY_RE = re.compile(r"^[-/_=.a-zA-Z0-9]+$")
_HISTORY = 1
#: seconds a load (or a revision check) of a reference table may take before it fails
LOAD_TIMEOUT = 30.0
#: a store with its own key-value role (Redis) keeps the table's revision under this key, which the
#: key alphabet cannot spell (JetStream's revision is the bucket stream's last sequence)
REVISION_KEY = "#revision"


class ReferenceError(Exception):
    """A reference table is missing or a row cannot be stored; the message says what to do."""


def _bucket_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def bucket_stream(pipeline: str, name: str) -> str:
    """The stream behind reference table ``name`` of ``pipeline``: its last sequence is the revision."""
    return _bucket_stream(naming.reference_bucket(pipeline, name))


def _not_found(pipeline: str, name: str, settings: NatsSettings) -> ReferenceError:
    return ReferenceError(
        f"reference table {name!r} of pipeline {pipeline} does not exist on {settings.display} "
        f"(KV bucket {naming.reference_bucket(pipeline, name)}): load it with "
        f"'isbflow ref put -f <spec> --name {name} --from-file <rows.json>'")


def _kind(value: Any) -> str | None:
    """A column value's type as a table column sees it (None for null); ValueError when not scalar."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    raise ValueError(type(value).__name__)


def check_rows(rows: Mapping[str, Any], where: str = "") -> None:
    """Raise :class:`ReferenceError` naming the first bad key or value (``where`` is added to the
    message: the bucket, on load). A row is an object of scalar columns; a column keeps one type."""
    kinds: dict[str, tuple[str, str]] = {}  # column -> (type, first key with it)
    for key, value in rows.items():
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise ReferenceError(f"reference key {key!r}{where} is not allowed: use letters, digits and - _ = / .")
        if not isinstance(value, Mapping):
            raise ReferenceError(f"reference row {key!r}{where} must be an object of columns, "
                                 f"got {type(value).__name__}")
        for column, v in value.items():
            if not isinstance(column, str) or not column:
                raise ReferenceError(f"reference row {key!r}{where}: column names are non-empty strings, "
                                     f"got {column!r}")
            try:
                kind = _kind(v)
            except ValueError:
                raise ReferenceError(f"reference row {key!r}{where}: column {column!r} must be a string, number, "
                                     f"boolean or null, got {type(v).__name__}") from None
            if kind is None:
                continue
            seen = kinds.setdefault(column, (kind, key))
            if seen[0] != kind:
                raise ReferenceError(f"reference row {key!r}{where}: column {column!r} is a {kind}, but a "
                                     f"{seen[0]} in row {seen[1]!r}: a column has one type")


def _encode(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


async def _entries(nc: Any, bucket: str) -> dict[str, bytes]:
    """Latest value of every live key (deleted keys left out), as of the bucket stream's last
    sequence now: its messages read in order by batched direct gets (:func:`isbflow.isb.read.read_range`;
    older revisions a key no longer keeps are gaps, skipped). No consumer is created: a pipeline's
    user may create none (:mod:`isbflow.isb.roles`)."""
    stream = _bucket_stream(bucket)
    out: dict[str, bytes] = {}
    state = await stream_state(nc, stream)
    if state is None or state.messages == 0:
        return out
    prefix = f"$KV.{bucket}."
    async for msgs in read_range(nc, stream, state.first_seq, state.last_seq, on_gap=lambda a, b: None):
        for _, data, headers, _ in msgs:
            key = str(headers.get("Nats-Subject", ""))[len(prefix):]
            if headers.get("KV-Operation") in (KV_DEL, KV_PURGE):
                out.pop(key, None)
            else:
                out[key] = data
    return out


async def put(settings: NatsSettings, pipeline: str, name: str, rows: Mapping[str, Mapping[str, Any]],
              *, replace: bool = False) -> dict[str, int]:
    """Store ``rows`` (key -> columns). Returns counts ``written``, ``unchanged``, ``deleted`` and ``revision``."""
    check_rows(rows)
    bucket = naming.reference_bucket(pipeline, name)
    async with session(settings, name="isbflow-ref") as nc:
        if _own_buckets(nc):
            return await _put_kv(await nc.kv(bucket), rows, replace)
        js = nc.jetstream()
        try:
            kv = await js.key_value(bucket)
        except BucketNotFoundError:
            kv = await js.create_key_value(KeyValueConfig(
                bucket=bucket, description=f"isbflow pipeline {pipeline}: reference table {name}",
                history=_HISTORY, storage=StorageType.FILE, direct=True))
        written, unchanged, deleted = await _write_rows(kv, await _entries(nc, bucket), rows, replace)
        revision = (await js.stream_info(_bucket_stream(bucket))).state.last_seq
    return {"written": written, "unchanged": unchanged, "deleted": deleted, "revision": revision}


async def _write_rows(kv: Any, current: Mapping[str, bytes], rows: Mapping[str, Mapping[str, Any]],
                      replace: bool) -> tuple[int, int, int]:
    """Put the rows whose value differs from ``current`` (and, ``replace``, delete the keys ``rows``
    lacks) through ``kv``'s ``put``/``delete`` (a JetStream KV or a :class:`KeyValue`); how many
    were written, unchanged and deleted."""
    written = unchanged = deleted = 0
    for key in sorted(rows):
        data = _encode(rows[key])
        if current.get(key) == data:
            unchanged += 1
            continue
        await kv.put(key, data)
        written += 1
    if replace:
        for key in sorted(set(current) - set(rows)):
            await kv.delete(key)
            deleted += 1
    return written, unchanged, deleted


async def current_revision(conn: Any, pipeline: str, name: str) -> int | None:
    """The table's revision on an open connection of either store, None when the table does not
    exist (what a running step asks on each beat: one small request)."""
    if _own_buckets(conn):
        rev = await (await conn.kv(naming.reference_bucket(pipeline, name))).get(REVISION_KEY)
        return None if rev is None else int(rev)
    state = await stream_state(conn, bucket_stream(pipeline, name))
    return state.last_seq if state is not None else None


def _own_buckets(conn: Any) -> bool:
    """True when ``conn`` is a store object with its own key-value role (Redis), whose tables are
    kept through :class:`isbflow.isb.store.KeyValue`; False for a nats-py client (KV streams)."""
    return callable(getattr(conn, "kv", None))


async def _put_kv(kv: KeyValue, rows: Mapping[str, Mapping[str, Any]], replace: bool) -> dict[str, int]:
    """:func:`put` on a store's key-value role: rows as keys, and the revision a counter under
    :data:`REVISION_KEY` (outside the key alphabet, so never a row), raised once per put that
    changed something."""
    current = await kv.items()
    current.pop(REVISION_KEY, None)
    written, unchanged, deleted = await _write_rows(kv, current, rows, replace)
    held = await kv.get(REVISION_KEY)
    revision = await kv.add(REVISION_KEY, 1) if written or deleted or held is None else int(held)
    return {"written": written, "unchanged": unchanged, "deleted": deleted, "revision": revision}


def _timed_out(pipeline: str, name: str, settings: NatsSettings, what: str, timeout: float) -> ReferenceError:
    return ReferenceError(
        f"{what} reference table {name!r} of pipeline {pipeline} (KV bucket {naming.reference_bucket(pipeline, name)}) "
        f"on {settings.display} timed out after {timeout:g} s: check the ISB service and the bucket "
        f"('isbflow ref get'), or load it again with 'isbflow ref put'")


async def _within(coro: Coroutine[Any, Any, T], timeout: float, error: ReferenceError) -> T:
    try:
        return await asyncio.wait_for(coro, timeout)
    except TimeoutError:
        raise error from None


async def revision(settings: NatsSettings, pipeline: str, name: str, timeout: float = LOAD_TIMEOUT) -> int:
    """The table's revision (:func:`current_revision`: one small request); :class:`ReferenceError` when
    the table does not exist."""
    async def go() -> int:
        async with session(settings, name="isbflow-ref") as nc:
            rev = await current_revision(nc, pipeline, name)
        if rev is None:
            raise _not_found(pipeline, name, settings)
        return rev

    return await _within(go(), timeout, _timed_out(pipeline, name, settings, "checking the revision of", timeout))


def to_table(rows: Mapping[str, Mapping[str, Any]], key: str = "key") -> pa.Table:
    """Rows as a table: ``key`` column first, then the value columns, sorted by key."""
    if not rows:
        return pa.table({key: pa.array([], pa.string())})
    records = [{key: k, **{c: v for c, v in rows[k].items() if c != key}} for k in sorted(rows)]
    return pa.Table.from_pylist(records)


def _decode(entries: Mapping[str, bytes], where: str) -> dict[str, Any]:
    rows = {}
    for key, raw in entries.items():
        try:
            rows[key] = json.loads(raw)
        except ValueError:
            raise ReferenceError(f"reference row {key!r}{where} is not JSON: store rows with "
                                 "'isbflow ref put'") from None
    check_rows(rows, where)
    return rows


async def load(settings: NatsSettings, pipeline: str, name: str, key: str = "key",
               timeout: float = LOAD_TIMEOUT) -> tuple[int, pa.Table]:
    """``(revision, table)`` of the reference table; :class:`ReferenceError` when it does not exist,
    when a row is not valid (naming its key) or when the load takes over ``timeout`` seconds.

    The revision is read before the values, so a put racing with the load makes
    the next revision check reload: never a stale table under a fresh revision.
    """
    bucket = naming.reference_bucket(pipeline, name)

    async def go() -> tuple[int, dict[str, bytes]]:
        async with session(settings, name="isbflow-ref") as nc:
            if _own_buckets(nc):
                entries = await (await nc.kv(bucket)).items()
                rev = entries.pop(REVISION_KEY, None)
                if rev is None:
                    raise _not_found(pipeline, name, settings)
                return int(rev), entries
            js = nc.jetstream()
            try:
                rev = (await js.stream_info(_bucket_stream(bucket))).state.last_seq
                await js.key_value(bucket)
            except (BucketNotFoundError, NotFoundError):
                raise _not_found(pipeline, name, settings) from None
            return rev, await _entries(nc, bucket)

    rev, entries = await _within(go(), timeout, _timed_out(pipeline, name, settings, "loading", timeout))
    return rev, to_table(_decode(entries, f" of KV bucket {bucket}"), key)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, even when this thread has a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, name="isbflow-ref")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class ReferenceCache:
    """The current reference table as a broadcastable Spark DataFrame, reloaded only on change.

    Runs on the driver: call :meth:`dataframe` once per micro-batch (e.g. in the
    step's transform) and join with it. ``loads`` counts reloads.
    """

    def __init__(self, settings: NatsSettings, pipeline: str, name: str, key: str = "key",
                 timeout: float = LOAD_TIMEOUT):
        self.settings, self.pipeline, self.name, self.key = settings, pipeline, name, key
        self.timeout = timeout
        self.revision: int | None = None
        self.loads = 0
        self._table: pa.Table | None = None
        self._frames: dict[int, DataFrame] = {}  # per SparkSession

    def table(self) -> pa.Table:
        """The current table, reloading it when the bucket's revision moved."""
        rev = _run(revision(self.settings, self.pipeline, self.name, self.timeout))
        if rev != self.revision or self._table is None:
            self.revision, self._table = _run(load(self.settings, self.pipeline, self.name, self.key, self.timeout))
            self.loads += 1
            self._frames.clear()
        return self._table

    def dataframe(self, spark: SparkSession) -> DataFrame:
        """``F.broadcast`` of the current table, built once per revision and session."""
        # lazy: Spark loads only in a step, and `isbflow ref` imports this module
        from pyspark.sql import functions as F

        table = self.table()
        df = self._frames.get(id(spark))
        if df is None:
            df = self._frames[id(spark)] = F.broadcast(spark.createDataFrame(table))
        return df
