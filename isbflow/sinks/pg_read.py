"""Reading a PostgreSQL sink back, as the quality checks do (:func:`read_snapshot`).

One read-only ``REPEATABLE READ`` transaction reads the table's rows and the
bookkeeping rows of its commits, so the offsets it reports as held are exactly
those of the rows it returns (the Delta sink's ``isb.offsets`` history, read at
one table version, gives the same guarantee). Rows come back as an Arrow table
whose types follow the columns' (:func:`arrow_type`): ``jsonb`` as its JSON
text, ``numeric(p, s)`` as a decimal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa

from isbflow.isb import ledger
from isbflow.sinks.pg_write import PostgresSinkError, PostgresTableMissing
from isbflow.sinks.postgres import PostgresTarget, bookkeeping_table, connect

_TYPES = {"text": pa.string(), "character varying": pa.string(), "boolean": pa.bool_(),
          "smallint": pa.int16(), "integer": pa.int32(), "bigint": pa.int64(), "real": pa.float32(),
          "double precision": pa.float64(), "date": pa.date32(), "bytea": pa.binary(),
          "timestamp with time zone": pa.timestamp("us", tz="UTC"),
          "timestamp without time zone": pa.timestamp("us"), "jsonb": pa.string(), "json": pa.string()}


def arrow_type(data_type: str, precision: int | None, scale: int | None) -> pa.DataType:
    """The Arrow type of a PostgreSQL column (``information_schema.columns.data_type``)."""
    if data_type == "numeric":
        return pa.decimal128(precision or 38, scale or 0)
    if data_type not in _TYPES:
        raise PostgresSinkError(f"column type {data_type!r} cannot be read back")
    return _TYPES[data_type]


@dataclass(frozen=True)
class PgSnapshot:
    """A PostgreSQL sink as one transaction saw it."""

    rows: pa.Table
    batches: int  # commits the bookkeeping table records for the table (the table's "version")
    held: dict  # the union of their offsets: what the table holds, per source partition
    last_offsets: dict  # the offsets of the newest commit


def read_snapshot(target: PostgresTarget) -> PgSnapshot:
    """The sink's rows and committed offsets, in one snapshot; :class:`PostgresTableMissing` (a
    :class:`~isbflow.sinks.pg_write.PostgresSinkError`) when the table does not exist yet."""
    # lazy: psycopg (~0.2 s); sinks.tables imports this module for every sink, Delta ones too
    from psycopg import IsolationLevel, sql

    table = target.spec.table
    schema, name = (table.split(".") if "." in table else ("public", table))
    conn = connect(target)
    try:
        conn.isolation_level = IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        with conn.transaction(), conn.cursor() as cur:
            cur.execute("SELECT column_name, data_type, numeric_precision, numeric_scale FROM "
                        "information_schema.columns WHERE table_schema = %s AND table_name = %s "
                        "ORDER BY ordinal_position", (schema, name))
            columns = cur.fetchall()
            if not columns:
                raise PostgresTableMissing(f"{target.where}: no table {table} yet: the sink has not committed "
                                        "a batch; run the pipeline first")
            arrow = pa.schema([(c, arrow_type(t, p, s)) for c, t, p, s in columns])
            jsons = {c for c, t, _, _ in columns if t in ("jsonb", "json")}
            select = sql.SQL(", ").join(
                sql.SQL("{}::text").format(sql.Identifier(c)) if c in jsons else sql.Identifier(c)
                for c, *_ in columns)
            cur.execute(sql.SQL("SELECT {} FROM {}").format(select, sql.Identifier(*table.split("."))))
            data = cur.fetchall()
            book = []
            cur.execute("SELECT 1 FROM information_schema.tables WHERE table_schema = %s AND table_name = %s",
                        (schema, bookkeeping_table(table).split(".")[-1]))
            if cur.fetchone():
                cur.execute(sql.SQL("SELECT offsets FROM {} WHERE target = %s ORDER BY committed_at, batch_id")
                            .format(sql.Identifier(*bookkeeping_table(table).split("."))), (table,))
                book = [ledger.from_metadata(json.dumps(r[0])) for r in cur.fetchall()]
    finally:
        conn.close()
    rows = pa.Table.from_arrays([pa.array([r[i] for r in data], f.type) for i, f in enumerate(arrow)],
                                schema=arrow)
    return PgSnapshot(rows, len(book), ledger.union(*book), book[-1] if book else {})
