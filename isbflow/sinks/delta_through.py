"""The commit side of a Delta sink written through: the read tasks wrote the Parquet, the driver commits.

A sink vertex written through (:mod:`isbflow.steps.write_through`) reads its input buffer in Spark
tasks that write the rows they read as the sink's Parquet files themselves
(:func:`isbflow.sinks.delta_files.write_batch_files`, pyarrow, in the same Python process that
decoded the frames) and hand Spark one :class:`~isbflow.sinks.delta_files.DeltaCommitMessage` each,
pickled into the first row of a column ``message`` that is otherwise null (one row per record the
task wrote, so Spark's ``numInputRows`` stays the number of records).

:class:`DeltaThroughWriter` is that query's ``foreachBatch`` function: it runs the batch's one job
(collecting the messages, never the rows) and commits them with
:func:`isbflow.sinks.delta_commit.commit_batch`, the same commit as every other Delta path (the
app-transaction check, ``isb.offsets``, the ledger, ``merge``/``upsert``, the clean-up of the
batch's unreferenced files). Collected once per call: a second collect would run the read tasks,
and so write the batch's files, again.
"""

from __future__ import annotations

import pickle
import time

from isbflow.sinks.delta_commit import BatchCommit, commit_batch
from isbflow.sinks.delta_files import DeltaCommitMessage
from isbflow.sinks.delta_spark import DeltaBatchWriter

#: the one column a written-through read yields
MESSAGE_COLUMN = "message"


def message_row(message: DeltaCommitMessage) -> bytes:
    """A task's commit message as the bytes of its ``message`` row."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


class DeltaThroughWriter(DeltaBatchWriter):
    """``foreachBatch`` function of a Delta sink written through (module docstring).

    ``seconds``: ``write`` is the batch's job (reading the buffer and writing the Parquet, in the
    tasks), ``commit`` the driver's Delta commit; ``adopt`` and ``offsets`` stay 0 (the tasks name
    their files and offsets in their messages).
    """

    def __call__(self, df, batch_id: int) -> BatchCommit:
        t = time.perf_counter()
        rows = df.where(df[MESSAGE_COLUMN].isNotNull()).select(MESSAGE_COLUMN).collect()
        messages = [pickle.loads(r[0]) for r in rows]  # noqa: S301 - this query's own tasks made them
        t = self._timed("write", t)
        done = commit_batch(self.options, messages, batch_id, self.tables)
        self._timed("commit", t)
        return done
