"""Fallback sinks (Numaflow's ``sink.fallback``): the table a sink's refused records go to, once per batch.

A fallback receives, from the driver as an Arrow table, the rows the primary
sink refused (a whole batch after its retries, or single rows it refused one by
one) with four columns more: ``_isb_error`` (the reason), ``_isb_attempts`` (the
attempts made), ``_isb_app`` and ``_isb_batch`` (the primary's app id and Spark
batch id). Like a primary it is exactly once per (app id, batch id):

- :class:`PostgresFallback`: :func:`isbflow.sinks.postgres.commit_batch` on the
  fallback table (its bookkeeping row, keyed on ``_isb_id`` when the rows have
  it), in append mode;
- :class:`DeltaFallback`: one delta-rs append on the driver carrying the app
  transaction ``(app id, batch id)``, after checking ``transaction_version``
  (delta-rs records it but does not enforce it), as the Delta sink does.

:meth:`held` answers a replay: the ``_isb_id`` values the fallback took for a
batch (``None`` when it took nothing for it), so the caller hands the primary
only the rest and no record lands in both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, Transaction, write_deltalake

from isbflow.isb import ledger
from isbflow.local.delta_arrow import arrow_dataset
from isbflow.sinks.delta_files import delta_arrow_schema
from isbflow.sinks.delta_merge import open_table
from isbflow.sinks.pg_write import ident, table_columns
from isbflow.sinks.postgres import PostgresTarget, bookkeeping_table, commit_batch, connect

ERROR_COLUMN = "_isb_error"
ATTEMPTS_COLUMN = "_isb_attempts"
APP_COLUMN = "_isb_app"
BATCH_COLUMN = "_isb_batch"
FALLBACK_COLUMNS = (ERROR_COLUMN, ATTEMPTS_COLUMN, APP_COLUMN, BATCH_COLUMN)


def with_reasons(rows: pa.Table, reasons: list[str] | str, attempts: int, app_id: str, batch_id: int) -> pa.Table:
    """``rows`` plus the fallback columns (one reason per row, or one for all)."""
    n = rows.num_rows
    reasons = [reasons] * n if isinstance(reasons, str) else reasons
    rows = rows.drop_columns([c for c in FALLBACK_COLUMNS if c in rows.schema.names])
    return (rows.append_column(ERROR_COLUMN, pa.array(reasons, pa.string()))
            .append_column(ATTEMPTS_COLUMN, pa.array([attempts] * n, pa.int32()))
            .append_column(APP_COLUMN, pa.array([app_id] * n, pa.string()))
            .append_column(BATCH_COLUMN, pa.array([batch_id] * n, pa.int64())))


@dataclass(frozen=True)
class PostgresFallback:
    """A PostgreSQL fallback table: ``target`` is the fallback's (its table, the primary's app id)."""

    target: PostgresTarget

    @property
    def where(self) -> str:
        return f"fallback {self.target.spec.table}"

    def commit(self, rows: pa.Table, batch_id: int) -> bool:
        """Commit ``rows`` (with the fallback columns) for ``batch_id``; False when it holds the batch."""
        out = commit_batch(replace(self.target, mode="append", version_column=None), rows, batch_id)
        return out.skipped_reason is None

    def held(self, batch_id: int) -> list[str] | None:
        from psycopg import sql  # lazy: psycopg holds ~8 MiB of a driver that writes no PostgreSQL

        t = self.target
        with connect(t) as conn, conn.cursor() as cur:
            if table_columns(cur, bookkeeping_table(t.spec.table)) is None:
                return None
            cur.execute(sql.SQL("SELECT 1 FROM {} WHERE app_id = %s AND target = %s AND batch_id = %s")
                        .format(ident(bookkeeping_table(t.spec.table))), (t.app_id, t.spec.table, batch_id))
            if cur.fetchone() is None:
                return None
            if ledger.ID_COLUMN not in (table_columns(cur, t.spec.table) or []):
                return []
            cur.execute(sql.SQL("SELECT {} FROM {} WHERE {} = %s AND {} = %s").format(
                sql.Identifier(ledger.ID_COLUMN), ident(t.spec.table), sql.Identifier(APP_COLUMN),
                sql.Identifier(BATCH_COLUMN)), (t.app_id, batch_id))
            return [r[0] for r in cur.fetchall()]


@dataclass(frozen=True)
class DeltaFallback:
    """A Delta fallback table at ``path`` (absolute), written on the driver with delta-rs."""

    path: str
    app_id: str

    @property
    def where(self) -> str:
        return f"fallback {self.path}"

    def _done(self, table) -> int | None:
        return table.transaction_version(self.app_id) if table is not None else None

    def commit(self, rows: pa.Table, batch_id: int) -> bool:
        done = self._done(open_table(self.path))
        if done is not None and done >= batch_id:
            return False
        rows = rows.cast(delta_arrow_schema(rows.schema))
        write_deltalake(self.path, rows, mode="append", schema_mode="merge",
                        commit_properties=CommitProperties(
                            app_transactions=[Transaction(app_id=self.app_id, version=batch_id)]))
        return True

    def held(self, batch_id: int) -> list[str] | None:
        table = open_table(self.path)
        done = self._done(table)
        if done is None or done < batch_id:
            return None
        data = arrow_dataset(table)
        if ledger.ID_COLUMN not in data.schema.names:
            return []
        flt = (pc.field(APP_COLUMN) == self.app_id) & (pc.field(BATCH_COLUMN) == batch_id)
        return data.to_table(columns=[ledger.ID_COLUMN], filter=flt).column(0).to_pylist()
