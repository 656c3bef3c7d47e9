"""The keys of one Redis buffer partition, and its offsets (entry ids).

Every key of a partition carries the partition's stream name (:mod:`isbflow.isb.naming`) in a
hash tag, ``isbflow:{<stream>}``, so a Redis Cluster keeps them in one slot and one script may
touch them all:

=============================  ==================================================================
key                            holds
=============================  ==================================================================
``isbflow:{<stream>}``         the stream: one entry per frame, fields ``id`` (the frame id),
                               ``rows`` and ``f`` (the frame's bytes)
``isbflow:{<stream>}:ids``     the dedup index: a sorted set of frame ids, each scored with the
                               millisecond part of its entry id
``isbflow:{<stream>}:inc``     the incarnation: a hash of ``id`` (random), ``created`` (ms),
                               ``released`` (entries removed by releases) and ``released_to``
                               (the highest entry id released)
=============================  ==================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

PREFIX = "isbflow:"


class EntryId(NamedTuple):
    """A Redis stream entry id ``<ms>-<seq>``, ordered as Redis orders entries."""

    ms: int
    seq: int

    @classmethod
    def parse(cls, text: str | bytes) -> EntryId:
        """``"1700000000000-3"`` (or its bytes) as an entry id; ``ValueError`` naming the text."""
        s = text.decode() if isinstance(text, bytes) else text
        ms, sep, seq = s.partition("-")
        try:
            if not sep:
                raise ValueError
            return cls(int(ms), int(seq))
        except ValueError:
            raise ValueError(f"{s!r} is not a Redis stream entry id (<ms>-<seq>)") from None

    def after(self) -> EntryId:
        """The smallest id greater than this one."""
        return EntryId(self.ms, self.seq + 1)

    def __str__(self) -> str:
        return f"{self.ms}-{self.seq}"


ZERO = EntryId(0, 0)


@dataclass(frozen=True)
class BufferKeys:
    """The keys of one partition stream (module doc)."""

    name: str

    @property
    def stream(self) -> str:
        return f"{PREFIX}{{{self.name}}}"

    @property
    def ids(self) -> str:
        return f"{self.stream}:ids"

    @property
    def incarnation(self) -> str:
        return f"{self.stream}:inc"

    @property
    def all(self) -> tuple[str, str, str]:
        """stream, ids, incarnation: the ``KEYS`` every script of :mod:`isbflow.isb.redis.scripts` takes."""
        return self.stream, self.ids, self.incarnation
