"""A sink's failure policy (Numaflow's ``retryStrategy`` and ``fallback``) around its ``foreachBatch`` function.

:class:`SinkPolicy` wraps any ``foreachBatch`` callable ``(df, batch_id)`` a
sink vertex writes with (the runner's ``_sink_writer`` builds it); it runs on
the driver, in the query's thread, once per micro-batch:

1. **replay**: when the fallback already holds this batch (the driver died
   after the fallback's commit, before Spark's checkpoint commit), the primary is
   handed only the rows the fallback does not hold (none, for a whole batch);
   a batch recorded as dropped is not written again. The fallback is asked only
   for a batch up to the last one sent there (noted on disk before its commit)
   or the last one finished, not for every batch;
2. **attempts**: the primary is called; when it raises, the attempt is counted
   (``sink_retries`` in the step's status), the error is shown while it lasts
   (``sink_error``), and after ``backoff.wait(n)`` (times ``1 + jitter * r``)
   the next attempt starts. Without a ``retryStrategy`` the first error fails
   the query, as before (the step's restart policy applies);
3. **onFailure**, once ``backoff.steps`` attempts failed: ``retry`` starts the
   backoff again, for ever; ``fallback`` commits the whole batch to the fallback
   (:mod:`isbflow.sinks.fallback`) with the last error and the attempt count;
   ``drop`` counts the batch's records as dropped (``dropped_total``, a warning
   in the log), never silently. Both record the batch's source offsets in the
   offset ledger, so a recovery does not bring them back. Before either, a primary that can tell (``holds(batch_id)``: the Delta sink,
   whose commit may land before the attempt fails) is asked whether it holds the
   batch already; if it does, the batch is done and nothing is sent or dropped;
4. **refused rows**: a primary that refuses rows one by one (a callable with
   ``takes_refused``, e.g. the PostgreSQL sink) hands them over before it
   commits the rest; they go to the fallback with their reasons (``fallback_total``),
   or, without one, to the dead-letter buffer (``dlq_total``).

The totals are kept in ``sink-policy.json`` in the sink query's stats folder,
counted once per Spark batch (a replayed batch adds nothing), and read again
when a driver starts. :meth:`SinkPolicy.cancel` (the runner's ``stop_all``)
ends a wait so a query retrying for ever can be stopped.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql import functions as F

from isbflow.isb import ledger
from isbflow.isb.connect import settings_from_json
from isbflow.isb.dlq import DeadLetter, publish_dead_letters_sync
from isbflow.sinks.fallback import DeltaFallback, PostgresFallback, with_reasons
from isbflow.spec.models import OnFailure, RetryStrategy
from isbflow.spec.paths import DataDir
from isbflow.steps.pg_sink import fallback_target

log = logging.getLogger(__name__)

STATS_FILE = "sink-policy.json"

#: dead-letters rows with their reasons for a batch; returns how many were stored anew
DeadLetterRows = Callable[[pa.Table, list[str], int], int]


class SinkRetriesCancelled(Exception):
    """The runner stopped a query while its sink was waiting to retry a batch."""


@dataclass
class PolicyTotals:
    """What a sink's policy has done, over the life of its checkpoint (``sink-policy.json``)."""

    retries: int = 0  # failed attempts
    fallback: int = 0  # records committed to the fallback (whole batches and refused rows)
    dropped: int = 0  # records dropped by onFailure: drop
    refused: int = 0  # records the primary refused one by one (to the fallback or the dead letters)
    dead_lettered: int = 0  # refused records sent to the dead-letter buffer
    last_batch: int = -1  # the last batch counted
    last_dropped: bool = False  # whether that batch was dropped (a replay of it drops nothing again)
    #: the last batch something was sent to the fallback for, noted before the fallback commits: only a
    #: batch up to it can be one the fallback holds, so later batches skip asking the fallback
    fallback_batch: int = -1

    @classmethod
    def read(cls, path: Path) -> PolicyTotals:
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls()
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)


class SinkPolicy:
    """The ``foreachBatch`` function of a sink with its failure policy (module doc)."""

    def __init__(self, write: Callable[..., Any], *, where: str, app_id: str,
                 strategy: RetryStrategy | None, fallback: Any = None,
                 dead_letter: DeadLetterRows | None = None, stats_dir: str | Path | None = None,
                 record_offsets: Callable[[dict], None] | None = None,
                 sleep: Callable[[float], bool] | None = None):
        self.write = write
        self.where = where
        self.app_id = app_id
        self.strategy = strategy
        self.fallback = fallback
        self.dead_letter = dead_letter
        self.stats_path = Path(stats_dir) / STATS_FILE if stats_dir else None
        self.totals = PolicyTotals.read(self.stats_path) if self.stats_path else PolicyTotals()
        self.record_offsets = record_offsets
        self.error: str | None = None  # the current failure while attempts go on
        self._stop = threading.Event()
        self._sleep = sleep or (lambda s: self._stop.wait(s))

    def cancel(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ one batch
    def __call__(self, df, batch_id: int) -> None:
        t = self.totals
        if batch_id == t.last_batch and t.last_dropped:
            log.info("%s: batch %d was dropped before; its replay drops nothing again", self.where, batch_id)
            return
        new = batch_id > t.last_batch
        counts = PolicyTotals()
        maybe_held = self.fallback is not None and batch_id <= max(t.fallback_batch, t.last_batch)
        held = self.fallback.held(batch_id) if maybe_held else None
        if held is not None:
            df = self._without(df, held)
            if df is None:
                log.info("%s: the fallback holds batch %d whole; nothing to write", self.where, batch_id)
                return
        attempt = 0
        while True:
            attempt += 1
            try:
                self._attempt(df, batch_id, attempt, counts)
                break
            except SinkRetriesCancelled:
                raise
            except Exception as e:  # noqa: BLE001 - every failure is the policy's to handle
                if self.strategy is None:
                    raise
                self._add(PolicyTotals(retries=1), True)
                first = str(e).splitlines()[0] if str(e) else repr(e)
                self.error = f"batch {batch_id}, attempt {attempt}: {first}"
                steps, action = self.strategy.backoff.steps, self.strategy.onFailure
                if steps is not None and attempt % steps == 0 and action != OnFailure.RETRY:
                    if self._primary_holds(batch_id):  # an attempt committed, then failed: nothing is lost
                        log.warning("%s: %s, but the table holds batch %d: nothing goes to the %s", self.where,
                                    self.error, batch_id, "fallback" if action == OnFailure.FALLBACK else "drop")
                        break
                    self._give_up(df, batch_id, attempt, str(e), action, counts)
                    break
                n = attempt if steps is None else (attempt - 1) % steps + 1
                wait = self.strategy.backoff.wait(n) * (1 + self.strategy.backoff.jitter * random.random())
                log.warning("%s: %s; attempt %d in %.3gs", self.where, self.error, attempt + 1, wait)
                if self._sleep(wait):
                    raise SinkRetriesCancelled(f"{self.where}: stopped while retrying batch {batch_id}") from e
        self.error = None
        counts.last_batch, counts.last_dropped = batch_id, counts.dropped > 0
        self._add(counts, new)

    def _primary_holds(self, batch_id: int) -> bool:
        """Whether the primary says it holds the batch (a primary with ``holds``, e.g. the Delta sink,
        whose commit may land before an attempt fails); False for one that cannot tell."""
        holds = getattr(self.write, "holds", None)
        return bool(holds(batch_id)) if holds is not None else False

    def _attempt(self, df, batch_id: int, attempt: int, counts: PolicyTotals) -> None:
        refused = PolicyTotals()
        if getattr(self.write, "takes_refused", False):
            def on_refused(rows: pa.Table, reasons: list[str]) -> None:
                refused.refused += rows.num_rows
                self._refused(rows, reasons, batch_id, attempt, refused)

            self.write(df, batch_id, on_refused=on_refused)
        else:
            self.write(df, batch_id)
        counts.refused += refused.refused
        counts.fallback += refused.fallback
        counts.dead_lettered += refused.dead_lettered

    def _refused(self, rows: pa.Table, reasons: list[str], batch_id: int, attempt: int,
                 counts: PolicyTotals) -> None:
        """Rows the primary refused one by one: to the fallback, else (or when the fallback already
        holds this batch without them) to the dead letters."""
        if self.fallback is not None:
            self._note_fallback(batch_id)
            if self.fallback.commit(with_reasons(rows, reasons, attempt, self.app_id, batch_id), batch_id):
                counts.fallback += rows.num_rows
                return
            # the fallback took this batch before (an earlier attempt whose primary commit then failed,
            # or a replay): what it holds is done, the rest goes to the dead letters
            held = set(self.fallback.held(batch_id) or [])
            if ledger.ID_COLUMN in rows.schema.names and held:
                keep = [i for i, x in enumerate(rows.column(ledger.ID_COLUMN).to_pylist()) if x not in held]
                rows, reasons = rows.take(pa.array(keep, pa.int64())), [reasons[i] for i in keep]
            if rows.num_rows == 0:
                return
            reasons = [f"{r} (the fallback already holds batch {batch_id})" for r in reasons]
        if self.dead_letter is None:
            raise RuntimeError(f"{self.where}: the table refused {rows.num_rows} row(s) and there is neither "
                               f"a fallback nor a dead-letter buffer; the first: {reasons[0]}")
        counts.dead_lettered += self.dead_letter(rows, reasons, batch_id)

    def _give_up(self, df, batch_id: int, attempts: int, error: str, action: OnFailure,
                 counts: PolicyTotals) -> None:
        rows = df.toArrow()
        if action == OnFailure.FALLBACK:
            reason = f"{self.where}: {attempts} attempts failed, the last: {error.splitlines()[0] if error else ''}"
            self._note_fallback(batch_id)
            self.fallback.commit(with_reasons(rows, reason, attempts, self.app_id, batch_id), batch_id)
            counts.fallback += rows.num_rows
            log.warning("%s: batch %d (%d records) went to the %s after %d attempts", self.where, batch_id,
                        rows.num_rows, self.fallback.where, attempts)
        else:
            counts.dropped += rows.num_rows
            log.warning("%s: batch %d DROPPED (%d records) after %d attempts (retryStrategy.onFailure: drop): %s",
                        self.where, batch_id, rows.num_rows, attempts, error.splitlines()[0] if error else "")
        if self.record_offsets is not None and ledger.ID_COLUMN in rows.schema.names:
            self.record_offsets(ledger.id_ranges(rows.column(ledger.ID_COLUMN)))

    def _without(self, df, held: list[str]):
        """``df`` less the rows whose ``_isb_id`` the fallback holds; None when nothing is left."""
        if ledger.ID_COLUMN not in df.columns or not held:
            return df
        if len(set(held)) >= df.count():  # a replay re-reads the same rows: the fallback took them all
            return None
        rest = df.filter(~F.col(ledger.ID_COLUMN).isin(held))
        return rest if not rest.isEmpty() else None

    def _note_fallback(self, batch_id: int) -> None:
        """Before a fallback commit: note the batch (kept on disk), so its replay asks the fallback."""
        if batch_id > self.totals.fallback_batch:
            self.totals.fallback_batch = batch_id
            if self.stats_path is not None:
                self.totals.write(self.stats_path)

    def _add(self, counts: PolicyTotals, new: bool) -> None:
        t = self.totals
        t.retries += counts.retries
        if new:
            t.fallback += counts.fallback
            t.dropped += counts.dropped
            t.refused += counts.refused
            t.dead_lettered += counts.dead_lettered
        if counts.last_batch >= 0:
            t.last_batch, t.last_dropped = max(t.last_batch, counts.last_batch), counts.last_dropped
        if self.stats_path is not None:
            t.write(self.stats_path)


# ------------------------------------------------------------------ wiring (the runner's hook)

def policy_for(runner, v, write: Callable[..., Any]) -> SinkPolicy:
    """``write`` (sink ``v``'s ``foreachBatch`` function) with ``v``'s failure policy: its fallback
    (the primary's app id), the pipeline's dead-letter buffer, totals in the sink query's stats."""
    app_id, fb = runner.sink_app_id(v.name), v.sink.fallback
    fallback = None
    if fb is not None and fb.postgres is not None:
        fallback = PostgresFallback(fallback_target(runner, v))
    elif fb is not None:
        path = Path(fb.delta.path)
        fallback = DeltaFallback(str(path if path.is_absolute() else runner.data_dir / path), app_id)
    settings = settings_from_json(runner.settings_json)

    def dead_letter(rows: pa.Table, reasons: list[str], batch_id: int) -> int:
        letters = [DeadLetter(record=r, reason=f"refused by sink {v.name!r}: {why}",
                              msg_id=f"{app_id}/{batch_id}/{r.get(ledger.ID_COLUMN) or i}")
                   for i, (r, why) in enumerate(zip(rows.to_pylist(), reasons, strict=True))]
        return publish_dead_letters_sync(settings, runner.p.name, v.name, letters)

    def record(offsets: dict) -> None:
        if offsets:
            ledger.record_sync(settings, runner.p.name, v.name, offsets)

    return SinkPolicy(write, where=f"sink {v.name!r}", app_id=app_id, strategy=v.sink.retryStrategy,
                      fallback=fallback, dead_letter=dead_letter, record_offsets=record,
                      stats_dir=DataDir(runner.data_dir).stats(runner.p.name, v.name, None))


def fold_status(status, policy: SinkPolicy | None) -> None:
    """The policy's totals into a step's heartbeat (``sink_retries``, ``fallback_total``, ``dropped_total``,
    ``refused_total``, ``sink_error`` while attempts fail)."""
    if policy is None:
        return
    t = policy.totals
    status.sink_retries, status.fallback_total, status.dropped_total = t.retries, t.fallback, t.dropped
    status.refused_total, status.sink_error = t.refused, policy.error
