"""What recovery reads from a PostgreSQL sink (:mod:`isbflow.sinks.postgres`), where it reads a
Delta sink's history and rows for the others.

- :func:`held`: the source offsets the sink's commits record (its bookkeeping
  rows: the Delta sink's ``isb.offsets`` history), united with the ledger KV
  to find the low offset;
- :func:`clock` and :func:`merge_stats`: the rows the replay's merge-mode
  commits offered and wrote (bookkeeping rows committed after the rewind);
- :func:`ids` and :func:`count_rows`: the verify phase's view of the table.

The replay itself needs nothing here: the runner writes a PostgreSQL sink in
``merge`` mode as ``INSERT ... ON CONFLICT (_isb_id) DO NOTHING``.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
from psycopg import sql

from isbflow.isb import ledger
from isbflow.sinks.postgres import (
    PostgresTarget,
    bookkeeping_table,
    committed_offsets,
    connect,
    table_columns,
)
from isbflow.spec.models import Pipeline


def target(p: Pipeline, sink: str, data_dir: str | Path) -> PostgresTarget:
    """A reader's target for sink ``sink`` (the app id only names the connection)."""
    return PostgresTarget(sink=sink, spec=p.vertex(sink).sink.postgres, app_id=f"{p.name}/{sink}:recover",
                          data_dir=str(Path(data_dir).absolute()), pipeline=p.name)


def held(t: PostgresTarget) -> ledger.PartitionRanges:
    return committed_offsets(t)


def _query(t: PostgresTarget, sql, params=()) -> list[tuple]:
    with connect(t) as conn, conn.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall()


def clock(t: PostgresTarget):
    """The server's clock now (bookkeeping rows after it are the replay's)."""
    return _query(t, "SELECT clock_timestamp()")[0][0]


def merge_stats(t: PostgresTarget, since) -> tuple[int, int]:
    """(rows offered, rows written) by the sink's commits after ``since``."""
    with connect(t) as conn, conn.cursor() as cur:
        if table_columns(cur, bookkeeping_table(t.spec.table)) is None:
            return 0, 0
        cur.execute(sql.SQL("SELECT coalesce(sum(rows), 0), coalesce(sum(written), 0) FROM {} "
                            "WHERE target = %s AND committed_at > %s")
                    .format(sql.Identifier(*bookkeeping_table(t.spec.table).split("."))), (t.spec.table, since))
        offered, written = cur.fetchone()
    return int(offered), int(written)


def ids(t: PostgresTarget) -> pa.Array:
    """Every ``_isb_id`` the table holds (one per row)."""
    rows = _query(t, sql.SQL("SELECT {} FROM {}").format(sql.Identifier(ledger.ID_COLUMN),
                                                         sql.Identifier(*t.spec.table.split("."))))
    return pa.array([r[0] for r in rows], pa.string())


def count_rows(t: PostgresTarget) -> int:
    return int(_query(t, sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(*t.spec.table.split("."))))[0][0])
