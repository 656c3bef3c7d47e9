"""Errors the JetStream connector raises for a user to read.

Each names the buffer (stream) and says what happened and what to do. They are
plain picklable exceptions: Spark executors raise them, Spark carries the message
back to the driver, and the query fails with it.
"""

from __future__ import annotations


class ConnectorOptionError(ValueError):
    """An option given to ``format("jetstream")`` is missing or malformed; the message names it."""


class BufferNotFound(Exception):
    """A stream the query should read does not exist (not provisioned, or deleted before the first batch)."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.stream = stream

    def __str__(self) -> str:
        return (f"buffer {self.stream} does not exist on the ISB service: provision the pipeline "
                "('isbflow isb apply') or check the 'streams' option")


class BufferLost(Exception):
    """Records of a buffer were lost before this query read them.

    ``lost_first``..``lost_last`` is the lost sequence range in the *old*
    incarnation of the stream (``lost_last`` is ``None`` when unknown, e.g. the
    stream vanished and its last sequence was never observed). ``reason`` says
    how (stream missing, recreated, first sequence moved past the offset, a
    sequence missing inside a read range).
    """

    def __init__(self, stream: str, lost_first: int, lost_last: int | None, reason: str):
        super().__init__(stream, lost_first, lost_last, reason)
        self.stream = stream
        self.lost_first = lost_first
        self.lost_last = lost_last
        self.reason = reason

    @property
    def range_text(self) -> str:
        if self.lost_last is None:
            return f"{self.lost_first} onward"
        if self.lost_last == self.lost_first:
            return str(self.lost_first)
        return f"{self.lost_first}-{self.lost_last}"

    @property
    def summary(self) -> str:
        """What was lost, without the advice (for logs under onBufferLoss=replay)."""
        return f"buffer {self.stream} lost sequences {self.range_text}: {self.reason}"

    def __str__(self) -> str:
        return (f"{self.summary}. Recover the pipeline ('isbflow replay -f SPEC --mode recover', or the "
                "pipeline_replay DAG), or set onBufferLoss=replay to continue from what the buffer still holds")


class BufferReadError(Exception):
    """Reading a buffer range failed for a reason other than loss (timeout, server error)."""


class LedgerFull(Exception):
    """A sink's offset ledger entry no longer fits in one NATS message, even compacted.

    Raised instead of logging and going on: a ledger that silently stops advancing
    makes recovery replay ever more and quality judge against a stale ledger.
    """

    def __init__(self, key: str, size: int, limit: int, ranges: int):
        super().__init__(key, size, limit, ranges)
        self.key, self.size, self.limit, self.ranges = key, size, limit, ranges

    def __str__(self) -> str:
        return (f"offset ledger entry {self.key} needs {self.size} bytes ({self.ranges} ranges) but a NATS "
                f"message holds at most {self.limit}: its gaps are not dead letters (a transform that drops "
                "records, or records that never arrived), so they cannot be folded. Raise the ISB service's "
                "settings.max_payload, or stop the step and check what the sink lacks "
                "('isbflow quality run -f SPEC')")
