"""The keys of the Redis store, and a buffer's offsets (entry ids ``0-<n>``).

Every key of a partition carries the partition's stream name (:mod:`isbflow.isb.naming`) in a
hash tag, ``isbflow:{<stream>}``, so a Redis Cluster keeps them in one slot and one script may
touch them all:

=============================  ==================================================================
key                            holds
=============================  ==================================================================
``isbflow:{<stream>}``         the stream: one entry per frame, fields ``id`` (the frame id),
                               ``rows``, ``f`` (the frame's bytes) and ``t`` (the server's write
                               time, ms)
``isbflow:{<stream>}:ids``     the dedup index: a sorted set of frame ids, each scored with its
                               entry's write time ``t``
``isbflow:{<stream>}:inc``     the incarnation: a hash of ``id`` (random), ``created`` (ms),
                               ``released`` (entries removed by releases), ``released_to`` (the
                               highest offset released) and ``wrote_at`` (the latest write time)
``isbflow:kv:{<bucket>}``      a key-value bucket (:mod:`isbflow.isb.redis.kv`): one hash, a field
                               per key
=============================  ==================================================================

Offsets are integers, as JetStream's stream sequences: entries are appended with id ``0-*``
(Redis 7 numbers the sequence part within an explicit millisecond part), so entry ``0-<n>`` is
offset ``n``, the first write to a stream is offset 1, and a stream released to empty keeps its
last generated id (Redis keeps an empty stream key), so offsets never go back. :class:`EntryId`
is the wire form; the store's methods take and return ``int``.
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

    @classmethod
    def of(cls, offset: int) -> EntryId:
        """The entry id of integer offset ``offset``: ``0-<offset>``."""
        return cls(0, offset)

    @property
    def offset(self) -> int:
        """This id as an integer offset; ``ValueError`` for an id isbflow did not append (``<ms>-<seq>``
        with ``ms`` > 0: an ``XADD *`` from outside the store)."""
        if self.ms != 0:
            raise ValueError(f"entry id {self} was not appended by isbflow (its entries are 0-<offset>)")
        return self.seq

    def __str__(self) -> str:
        return f"{self.ms}-{self.seq}"


def offset_of(text: str | bytes) -> int:
    """An entry id on the wire (``"0-3"`` or its bytes) as an integer offset (3)."""
    return EntryId.parse(text).offset


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


def kv_key(bucket: str) -> str:
    """The hash holding key-value bucket ``bucket`` (the bucket in the hash tag)."""
    return f"{PREFIX}kv:{{{bucket}}}"
