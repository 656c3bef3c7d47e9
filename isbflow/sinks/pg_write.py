"""One micro-batch into a PostgreSQL sink's table, inside the caller's transaction, refusing bad rows one by one.

:func:`write_rows` ``COPY``s the batch into a temporary staging table (the
target's column types), then moves it into the target with one
``INSERT ... SELECT`` (``ON CONFLICT`` on the sink's key: ``DO NOTHING``, or
``DO UPDATE`` for ``upsert``), all under a savepoint. When that fails with a
**row-level** error (SQLSTATE class 22, a value that does not fit its column,
or 23, a constraint violation: a ``NOT NULL``, a ``CHECK``, a foreign key, a
unique index other than the key) the batch is bisected: each half is tried
under its own savepoint, halves that fail are split again, down to single rows,
which are the refused rows (:class:`RefusedRows`, each with the server's
message as its reason). The rest is written, in the same transaction. Cost: the
happy path is one savepoint more; ``k`` bad rows in ``n`` cost about
``2 k log2(n)`` small statements more. Any other error (a lost connection, a
missing column, a full disk) is raised: the whole batch failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.csv as pacsv

if TYPE_CHECKING:
    from isbflow.sinks.postgres import PostgresTarget

#: SQLSTATE classes of errors a single row causes: data exception, integrity constraint violation
ROW_ERROR_CLASSES = ("22", "23")
STAGE_TABLE = "isb_stage"


class PostgresSinkError(Exception):
    """The PostgreSQL sink could not connect or commit; the message names the sink and the server."""


class PostgresTableMissing(PostgresSinkError):
    """The sink's table does not exist yet (no batch committed)."""


@dataclass(frozen=True)
class RefusedRows:
    """Rows of a batch the table refused one by one: their positions in the batch and why."""

    positions: list[int]
    reasons: list[str]

    def rows(self, batch: pa.Table) -> pa.Table:
        return batch.take(pa.array(self.positions, pa.int64()))

    def __len__(self) -> int:
        return len(self.positions)


def ident(name: str):
    """``name`` or ``schema.name`` as a quoted SQL identifier."""
    from psycopg import sql  # lazy: psycopg (~0.2 s); `isbflow --help` loads this module

    return sql.Identifier(*name.split("."))


def table_columns(cur, table: str) -> list[str] | None:
    """The columns of ``table`` in order; None when it does not exist."""
    schema = table.split(".")[0] if "." in table else "public"
    cur.execute("SELECT column_name FROM information_schema.columns WHERE table_schema = %s "
                "AND table_name = %s ORDER BY ordinal_position", (schema, table.split(".")[-1]))
    names = [r[0] for r in cur.fetchall()]
    return names or None


def _nested(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_struct(t) or pa.types.is_map(t) or pa.types.is_large_list(t)


def _rows(table: pa.Table):
    """Row tuples for COPY; nested values as JSON."""
    # lazy: psycopg (~0.2 s); `isbflow --help` loads this module
    from psycopg.types.json import Jsonb

    cols = []
    for f, col in zip(table.schema, table.columns, strict=True):
        values = col.to_pylist()
        if _nested(f.type):
            values = [None if v is None else Jsonb(v) for v in values]
        cols.append(values)
    return zip(*cols, strict=True)


def _flat(t: pa.DataType) -> bool:
    """Types Arrow's CSV writer renders as PostgreSQL reads them."""
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)
            or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_decimal(t)
            or pa.types.is_date(t) or pa.types.is_timestamp(t))


def copy_rows(cur, stage, table: pa.Table) -> None:
    """COPY ``table`` into the staging table: as CSV written by Arrow (vectorised) when every column
    is flat, else row by row (nested values as JSON)."""
    from psycopg import sql  # lazy: psycopg (~0.2 s); `isbflow --help` loads this module

    names = sql.SQL(", ").join(map(sql.Identifier, table.schema.names))
    if all(_flat(f.type) for f in table.schema):
        sink = pa.BufferOutputStream()
        # nulls unquoted and empty, every string quoted: PostgreSQL's CSV tells NULL from ''
        pacsv.write_csv(table, sink, pacsv.WriteOptions(include_header=False, quoting_style="all_valid"))
        with cur.copy(sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(stage, names)) as cp:
            cp.write(sink.getvalue().to_pybytes())
        return
    with cur.copy(sql.SQL("COPY {} ({}) FROM STDIN").format(stage, names)) as cp:
        for row in _rows(table):
            cp.write_row(row)


def is_row_error(e: BaseException) -> bool:
    """Whether PostgreSQL refused a row (SQLSTATE class 22 or 23), not the whole batch."""
    state = getattr(e, "sqlstate", None) or ""
    return state[:2] in ROW_ERROR_CLASSES


def row_reason(e: BaseException) -> str:
    """The server's one-line message and SQLSTATE, plus its detail line when it names the value."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    detail = getattr(getattr(e, "diag", None), "message_detail", None)
    return f"{text} (SQLSTATE {getattr(e, 'sqlstate', '?')})" + (f"; {detail}" if detail else "")


def _insert_sql(target: PostgresTarget, names: Sequence[str], copied: Sequence[str], stage):
    from psycopg import sql  # lazy: psycopg (~0.2 s); `isbflow --help` loads this module

    cols = sql.SQL(", ").join(map(sql.Identifier, names))
    source = sql.SQL("SELECT {} FROM {}").format(cols, stage)
    key = [k for k in target.key if k in names]
    if key and target.version_column in copied:  # the latest version of each key in the batch
        keys = sql.SQL(", ").join(map(sql.Identifier, key))
        source = sql.SQL("SELECT DISTINCT ON ({}) {} FROM {} ORDER BY {}, {} DESC").format(
            keys, cols, stage, keys, sql.Identifier(target.version_column))
    insert = sql.SQL("INSERT INTO {} ({}) {}").format(ident(target.spec.table), cols, source)
    if key:
        keys = sql.SQL(", ").join(map(sql.Identifier, key))
        rest = [n for n in names if n not in key]
        if target.mode == "upsert" and rest:
            sets = sql.SQL(", ").join(sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(n), sql.Identifier(n))
                                      for n in rest)
            insert += sql.SQL(" ON CONFLICT ({}) DO UPDATE SET {}").format(keys, sets)
        else:
            insert += sql.SQL(" ON CONFLICT ({}) DO NOTHING").format(keys)
    return insert


def write_rows(cur, target: PostgresTarget, batch: pa.Table) -> tuple[int, RefusedRows]:
    """Write ``batch`` into the target within the open transaction (module doc): (rows inserted or
    updated, the rows refused one by one)."""
    from psycopg import sql  # lazy: psycopg (~0.2 s); `isbflow --help` loads this module

    have = table_columns(cur, target.spec.table) or []
    names = [n for n in batch.schema.names if n != target.version_column]
    missing = [n for n in names if n not in have]
    if missing:
        raise PostgresSinkError(f"{target.where}: the batch's columns {missing} are not in the table "
                                f"(it has {', '.join(have)}); add them or write to a new table")
    stage = sql.Identifier(STAGE_TABLE)
    cur.execute(sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT {} FROM {} WITH NO DATA")
                .format(stage, sql.SQL(", ").join(map(sql.Identifier, names)), ident(target.spec.table)))
    copied = list(names)
    if target.version_column and target.version_column in batch.schema.names:
        cur.execute(sql.SQL("ALTER TABLE {} ADD COLUMN {} bigint").format(stage, sql.Identifier(target.version_column)))
        copied.append(target.version_column)
    data = batch.select(copied)
    insert = _insert_sql(target, names, copied, stage)
    written, positions, reasons = 0, [], []
    todo = [(0, data.num_rows)]  # a stack of [lo, hi) slices, in batch order
    fresh = True
    while todo:
        lo, hi = todo.pop()
        try:
            with cur.connection.transaction():  # a savepoint: a refused slice leaves nothing behind
                if not fresh:
                    cur.execute(sql.SQL("TRUNCATE {}").format(stage))
                fresh = False
                copy_rows(cur, stage, data.slice(lo, hi - lo))
                cur.execute(insert)
                written += max(0, cur.rowcount)
        except Exception as e:
            if not is_row_error(e):
                raise
            if hi - lo == 1:
                positions.append(lo)
                reasons.append(row_reason(e))
            else:
                mid = (lo + hi) // 2
                todo += [(mid, hi), (lo, mid)]
    return written, RefusedRows(positions, reasons)
