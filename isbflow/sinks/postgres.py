"""PostgreSQL sink: one database transaction per micro-batch, at most once per (app id, batch id).

A sink vertex with ``sink.postgres`` (:class:`isbflow.spec.postgres.PostgresSink`)
is written with ``foreachBatch``: :class:`PostgresBatchWriter` runs on the
driver once per micro-batch, brings the batch's rows to the driver as Arrow
(``DataFrame.toArrow``) and commits them in **one transaction** that:

1. takes a transaction-scoped advisory lock on the app id (one writer per app id
   at a time, as Spark's checkpoint already demands);
2. reads the bookkeeping table ``isb_sink_batches`` (in the target table's
   schema, primary key ``(app_id, target, batch_id)``: the target table is in
   the key so that pointing a sink at a new table does not skip its first
   batches): if it records this app id and table at this batch id or later, the batch was committed before (Spark replays a batch
   whose transaction landed but whose checkpoint commit did not) and the
   transaction commits nothing;
3. ``COPY``s the rows into a temporary staging table (``ON COMMIT DROP``, the
   target's column types), then moves them into the target with one
   ``INSERT ... SELECT``: ``ON CONFLICT (key) DO NOTHING`` (``append``, and
   ``merge`` for recovery: a row whose key the table holds is not inserted again)
   or ``DO UPDATE`` (``upsert``: the sink of a ``udf.output: update`` step, the
   latest ``versionColumn`` per key). Rows the table refuses one by one (a constraint
   violation, a value that does not fit its column) are found by bisecting the batch under
   savepoints (:mod:`isbflow.sinks.pg_write`) and handed to ``on_refused`` (the sink's failure
   policy: its fallback or the dead letters) before the rest commits;
4. inserts the bookkeeping row ``(app_id, target, batch_id, sink, rows, written, offsets)``
   (``rows`` the batch offered, ``written`` those inserted or updated: recovery's merge stats); the
   offsets are the batch's source ranges (:func:`isbflow.isb.ledger.id_ranges`
   of its ``_isb_id`` column), the table's own record of what it holds, like
   the Delta sink's ``isb.offsets`` commit metadata.

After the commit the offsets are added to the pipeline's offset ledger (KV),
as the Delta sink does: a failure there is logged (the bookkeeping table still
holds them), :class:`~isbflow.isb.errors.LedgerFull` fails the step.

Rows carrying ``_isb_id`` are keyed on it (``PRIMARY KEY``): no id is ever in
the table twice, whatever is replayed. The table, and the bookkeeping table,
are created when missing: the target from the batch's schema (the step's
output schema, :func:`pg_type` maps Spark's types), keyed as above.

Passwords: the writer is built with the spec's connection settings only; the
password is resolved on the driver when it connects (:func:`connect_kwargs`)
from ``AIRFLOW_CONN_<ID>`` (an Airflow connection of type postgres: any other
type is refused, :func:`check_connection_type`) or ``passwordFile`` (a file in
the secrets folder, :func:`isbflow.spec.paths.secret_file`) / ``passwordEnv``
(with a ``dsn``). It is never in Spark's options and is
scrubbed from the errors raised here.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

import pyarrow as pa

from isbflow.isb import ledger
from isbflow.isb.connect import settings_from_json
from isbflow.isb.errors import LedgerFull
from isbflow.sinks.pg_write import (  # noqa: F401 - PostgresSinkError, table_columns re-exported
    PostgresSinkError,
    RefusedRows,
    ident,
    table_columns,
    write_rows,
)
from isbflow.spec.paths import SecretFileError, secret_file
from isbflow.spec.postgres import PostgresSink

_log = logging.getLogger(__name__)

BOOKKEEPING_TABLE = "isb_sink_batches"
#: the Airflow connection types a postgres sink's ``connection`` may name (JSON ``conn_type``, URI scheme)
CONNECTION_TYPES = ("postgres", "postgresql")
MODES = ("append", "merge", "upsert")


@dataclass(frozen=True)
class PostgresTarget:
    """Everything the driver needs to write one sink (no password: that is resolved on connect)."""

    sink: str  # the sink vertex
    spec: PostgresSink
    app_id: str
    mode: str = "append"
    #: the conflict key: ``_isb_id`` by default, the update step's keys for ``upsert``
    key: tuple[str, ...] = (ledger.ID_COLUMN,)
    version_column: str | None = None
    data_dir: str = "."
    pipeline: str = ""
    ledger_settings: str = ""  # NatsSettings JSON; empty: record no offsets in the ledger KV
    environ: dict[str, str] | None = field(default=None, compare=False)  # tests; default os.environ

    @property
    def where(self) -> str:
        how = f"connection {self.spec.connection!r}" if self.spec.connection else f"dsn {self.spec.dsn!r}"
        return f"postgres sink {self.sink!r} (table {self.spec.table}, {how})"


# ------------------------------------------------------------------ connection settings

def connection_env(conn_id: str) -> str:
    """The environment variable Airflow reads connection ``conn_id`` from: ``AIRFLOW_CONN_<ID>``."""
    return "AIRFLOW_CONN_" + conn_id.upper().replace("-", "_").replace(".", "_")


def connection_type(value: str) -> str:
    """The type of an ``AIRFLOW_CONN_<ID>`` value: Airflow's JSON form's ``conn_type``, else the URI's
    scheme ('' when it names none)."""
    if value.lstrip().startswith("{"):
        try:
            c = json.loads(value)
        except json.JSONDecodeError:
            return ""
        return str(c.get("conn_type") or "") if isinstance(c, dict) else ""
    return urlsplit(value.strip()).scheme


def check_connection_type(conn_id: str, value: str, where: str = "postgres sink") -> None:
    """:class:`PostgresSinkError` unless ``value`` (``AIRFLOW_CONN_<ID>`` of ``conn_id``) is a PostgreSQL
    connection: a spec's ``connection`` must not reach another service's credentials (the ISB's
    ``nats_default``, a cloud key) through the sink."""
    kind = connection_type(value)
    if kind.lower() not in CONNECTION_TYPES:
        raise PostgresSinkError(
            f"{where}: sink.postgres.connection {conn_id!r} ({connection_env(conn_id)}) is a connection of type "
            f"{kind or 'unknown'!r}, not postgres: name an Airflow connection of type postgres")


def airflow_connection(conn_id: str, environ: dict[str, str] | None = None,
                       where: str = "postgres sink") -> dict[str, object]:
    """psycopg keyword arguments of Airflow connection ``conn_id`` from ``AIRFLOW_CONN_<ID>``
    (URI ``postgres://user:pass@host:port/db?sslmode=...`` or Airflow's JSON form, ``conn_type``
    postgres); :class:`PostgresSinkError` for a connection of another type (``where`` names the sink)."""
    env = os.environ if environ is None else environ
    name = connection_env(conn_id)
    value = env.get(name)
    if not value:
        raise PostgresSinkError(f"Airflow connection {conn_id!r} is not defined: set {name} (URI "
                                "postgres://user:password@host:port/db, or Airflow's JSON form) in the "
                                "environment the step runs in")
    check_connection_type(conn_id, value, where)
    if value.lstrip().startswith("{"):
        try:
            c = json.loads(value)
        except json.JSONDecodeError as e:
            raise PostgresSinkError(f"{name} is not valid JSON ({e.msg} at {e.pos})") from None
        extra = c.get("extra") or {}
        if isinstance(extra, str):
            extra = json.loads(extra or "{}")
        out = {"host": c.get("host"), "port": c.get("port"), "user": c.get("login"),
               "password": c.get("password"), "dbname": c.get("schema")}
    else:
        parts = urlsplit(value)
        extra = dict(parse_qsl(parts.query))
        out = {"host": parts.hostname, "port": parts.port, "user": unquote(parts.username or "") or None,
               "password": unquote(parts.password) if parts.password is not None else None,
               "dbname": unquote(parts.path.lstrip("/")) or None}
    out.update({k: v for k, v in extra.items() if k in ("sslmode", "sslrootcert", "connect_timeout",
                                                         "application_name", "options")})
    return {k: v for k, v in out.items() if v not in (None, "")}


def connect_kwargs(target: PostgresTarget) -> dict[str, object]:
    """The psycopg ``connect`` arguments of a sink, its password resolved here (driver only)."""
    spec, env = target.spec, (os.environ if target.environ is None else target.environ)
    if spec.connection:
        kw = airflow_connection(spec.connection, env, target.where)
    else:
        kw = {"conninfo": spec.dsn}
        if spec.passwordEnv:
            if spec.passwordEnv not in env:
                raise PostgresSinkError(f"{target.where}: passwordEnv {spec.passwordEnv} is not set")
            kw["password"] = env[spec.passwordEnv]
        elif spec.passwordFile:
            try:
                path = secret_file(spec.passwordFile, "sink.postgres.passwordFile", target.data_dir)
            except SecretFileError as e:
                raise PostgresSinkError(f"{target.where}: {e}") from None
            try:
                mode = path.stat().st_mode
                if mode & 0o077:
                    raise PostgresSinkError(f"{target.where}: passwordFile {path} is readable by others "
                                            f"(mode {mode & 0o777:o}): chmod 600 it")
                kw["password"] = (path.read_text().splitlines() or [""])[0]
            except OSError as e:
                raise PostgresSinkError(f"{target.where}: cannot read passwordFile {path}: "
                                        f"{e.strerror}") from None
    kw.setdefault("connect_timeout", 10)
    kw["application_name"] = f"isbflow {target.app_id}"[:63]
    return kw


def connect(target: PostgresTarget):
    """A psycopg connection to the sink's server; :class:`PostgresSinkError` naming the sink and its
    connection (never the password) when that fails."""
    import psycopg  # lazy: psycopg (~0.2 s); `isbflow --help` loads this module

    kw = connect_kwargs(target)
    try:
        return psycopg.connect(**kw)
    except psycopg.Error as e:
        raise PostgresSinkError(f"{target.where}: cannot connect: {_scrub(str(e), kw)}") from None


def _scrub(text: str, kw: dict) -> str:
    password = kw.get("password")
    return text.replace(str(password), "***") if password else text


# ------------------------------------------------------------------ tables

def _schema_of(table: str) -> str | None:
    return table.split(".")[0] if "." in table else None


def bookkeeping_table(table: str) -> str:
    """The bookkeeping table beside ``table`` (same schema)."""
    schema = _schema_of(table)
    return f"{schema}.{BOOKKEEPING_TABLE}" if schema else BOOKKEEPING_TABLE


def pg_type(t: pa.DataType) -> str:
    """The PostgreSQL column type of an Arrow type (Spark's types as ``toArrow`` gives them)."""
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text"
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_int8(t) or pa.types.is_int16(t):
        return "smallint"
    if pa.types.is_int32(t):
        return "integer"
    if pa.types.is_int64(t):
        return "bigint"
    if pa.types.is_float32(t):
        return "real"
    if pa.types.is_float64(t):
        return "double precision"
    if pa.types.is_decimal(t):
        return f"numeric({t.precision},{t.scale})"
    if pa.types.is_date(t):
        return "date"
    if pa.types.is_timestamp(t):
        return "timestamptz" if t.tz else "timestamp"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "bytea"
    if pa.types.is_list(t) or pa.types.is_struct(t) or pa.types.is_map(t) or pa.types.is_large_list(t):
        return "jsonb"
    raise PostgresSinkError(f"no PostgreSQL type for Arrow type {t}")


def _column_type(target: PostgresTarget, f: pa.Field) -> str:
    try:
        return pg_type(f.type)
    except PostgresSinkError as e:
        raise PostgresSinkError(f"{target.where}: column {f.name!r}: {e}; cast it in the step's "
                                "transform") from None


def create_tables(cur, target: PostgresTarget, schema: pa.Schema) -> None:
    """Create the bookkeeping table and (from ``schema``) the target, each when missing."""
    from psycopg import sql  # lazy: psycopg (~0.2 s); `isbflow --help` loads this module

    book = bookkeeping_table(target.spec.table)
    if _schema_of(target.spec.table):
        cur.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(_schema_of(target.spec.table))))
    cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (app_id text NOT NULL, target text NOT NULL, "
                        "batch_id bigint NOT NULL, sink text NOT NULL, rows bigint NOT NULL, "
                        "written bigint NOT NULL, offsets jsonb NOT NULL, committed_at timestamptz NOT NULL DEFAULT now(), "
                        "PRIMARY KEY (app_id, target, batch_id))")
                .format(ident(book)))
    columns = [f for f in schema if f.name != target.version_column]
    key = [k for k in target.key if k in schema.names]
    cols = [sql.SQL("{} {}").format(sql.Identifier(f.name), sql.SQL(_column_type(target, f))) for f in columns]
    if key:
        cols.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(map(sql.Identifier, key))))
    cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(ident(target.spec.table),
                                                                    sql.SQL(", ").join(cols)))


# ------------------------------------------------------------------ one batch

@dataclass(frozen=True)
class PgBatchCommit:
    """Outcome of one micro-batch: rows written (inserted or updated), or why nothing was."""

    batch_id: int
    rows: int
    written: int
    skipped_reason: str | None = None
    offsets: dict = field(default_factory=dict)
    refused: int = 0  # rows the table refused one by one (handed to ``on_refused``)


#: what :func:`commit_batch` calls with the rows the table refused one by one (an Arrow table of
#: them, and one reason per row) before it commits the rest; raising there commits nothing
OnRefused = Callable[[pa.Table, list[str]], None]


def commit_batch(target: PostgresTarget, batch: pa.Table, batch_id: int, conn=None,
                 on_refused: OnRefused | None = None) -> PgBatchCommit:
    """Commit one micro-batch in one transaction, at most once per (app id, batch id) (module doc).

    Rows the table refuses one by one (:mod:`isbflow.sinks.pg_write`) are handed to ``on_refused``
    inside the transaction, before the rest commits (so a fallback holds them before the batch is
    recorded as done); without ``on_refused`` they fail the batch, naming the first one."""
    from psycopg import sql  # lazy: psycopg (~0.2 s); `isbflow --help` loads this module

    if target.mode not in MODES:
        raise PostgresSinkError(f"{target.where}: mode {target.mode!r} is not one of {', '.join(MODES)}")
    offsets = ledger.id_ranges(batch.column(ledger.ID_COLUMN)) if ledger.ID_COLUMN in batch.schema.names else {}
    if batch.num_rows == 0:
        return PgBatchCommit(batch_id, 0, 0, "empty batch")
    own = conn is None
    conn = conn or connect(target)
    try:
        with conn.transaction(), conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (target.app_id,))
            create_tables(cur, target, batch.schema)
            book = ident(bookkeeping_table(target.spec.table))
            cur.execute(sql.SQL("SELECT max(batch_id) FROM {} WHERE app_id = %s AND target = %s").format(book),
                        (target.app_id, target.spec.table))
            done = cur.fetchone()[0]
            if done is not None and done >= batch_id:
                if done > batch_id:
                    _log.warning("%s: the table already holds batch %d of app id %s, so batch %d is "
                                 "skipped; if the step's checkpoint was reset, give the sink a new app "
                                 "id or restore the checkpoint", target.where, done, target.app_id, batch_id)
                return PgBatchCommit(batch_id, batch.num_rows, 0, f"table already holds batch {done}")
            written, refused = write_rows(cur, target, batch)
            if refused:
                if on_refused is None:
                    raise PostgresSinkError(f"{target.where}: batch {batch_id} not committed: the table refused "
                                            f"{len(refused)} row(s), the first (row {refused.positions[0]}): "
                                            f"{refused.reasons[0]}")
                on_refused(refused.rows(batch), refused.reasons)
            cur.execute(sql.SQL("INSERT INTO {} (app_id, target, batch_id, sink, rows, written, offsets) "
                                "VALUES (%s, %s, %s, %s, %s, %s, %s)").format(book),
                        (target.app_id, target.spec.table, batch_id, target.sink, batch.num_rows, written,
                         ledger.to_metadata(offsets)))
    except PostgresSinkError:
        raise
    except Exception as e:
        import psycopg  # lazy: psycopg (~0.2 s); `isbflow --help` loads this module

        if isinstance(e, psycopg.Error):
            raise PostgresSinkError(f"{target.where}: batch {batch_id} not committed: "
                                    f"{str(e).splitlines()[0]}") from e
        raise
    finally:
        if own:
            conn.close()
    record_offsets(target, offsets)
    return PgBatchCommit(batch_id, batch.num_rows, written, offsets=offsets, refused=len(refused))


def record_offsets(target: PostgresTarget, offsets: dict) -> None:
    """Add the batch's source offsets to the ledger KV, after the commit (as the Delta sink does)."""
    if not offsets or not target.ledger_settings:
        return
    try:
        ledger.record_sync(settings_from_json(target.ledger_settings), target.pipeline, target.sink, offsets)
    except LedgerFull:
        raise
    except Exception as e:  # noqa: BLE001 - the bookkeeping table still holds them; the ledger may lag
        _log.warning("%s: recording offsets in the ledger failed (%s); %s still holds them",
                     target.where, e, BOOKKEEPING_TABLE)


def committed_offsets(target: PostgresTarget, conn=None) -> dict:
    """The union of the offsets the bookkeeping table records for the sink's table (every app id)."""
    from psycopg import sql  # lazy: psycopg (~0.2 s); `isbflow --help` loads this module

    own = conn is None
    conn = conn or connect(target)
    try:
        with conn.cursor() as cur:
            if table_columns(cur, bookkeeping_table(target.spec.table)) is None:
                return {}
            cur.execute(sql.SQL("SELECT offsets FROM {} WHERE target = %s")
                        .format(ident(bookkeeping_table(target.spec.table))), (target.spec.table,))
            return ledger.union(*(ledger.from_metadata(json.dumps(r[0])) for r in cur.fetchall()))
    finally:
        if own:
            conn.close()


class PostgresBatchWriter:
    """The ``foreachBatch`` function of a PostgreSQL sink; runs on the driver once per micro-batch."""

    def __init__(self, target: PostgresTarget):
        self.target = target

    def check(self, columns: Sequence[str]) -> None:
        """At the step's start: the server answers and the key columns are in the stream."""
        missing = [k for k in self.target.key if k not in columns] if self.target.mode == "upsert" else []
        if missing:
            raise PostgresSinkError(f"{self.target.where}: key columns {missing} are not in the stream's "
                                    f"columns {list(columns)}")
        connect(self.target).close()

    #: hands rows the table refuses one by one to ``on_refused`` (:mod:`isbflow.steps.sink_policy`)
    takes_refused = True

    def __call__(self, df, batch_id: int, on_refused: OnRefused | None = None) -> None:
        commit_batch(self.target, df.toArrow(), batch_id, on_refused=on_refused)
