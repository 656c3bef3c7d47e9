"""Loss detection on Redis: is a partition gone, recreated, trimmed or behind what its reader read?

Redis can lose a buffer in ways an empty stream would hide: ``FLUSHALL``, a restart without
persistence (or with an AOF that missed its last second), eviction, or a failover to a replica
that had not received the master's last writes. So every partition has an incarnation
(:mod:`isbflow.isb.redis.keys`), made with the partition and counting what releases removed.
:func:`judge` compares it and the stream's own counters (``XINFO STREAM``: ``entries-added``,
``length``, first entry, ``last-generated-id``) with what the reader has seen
(:class:`isbflow.isb.store.ReaderPosition`: the incarnation and the last offset it read; offsets
are integers, entry ``0-<n>`` being offset ``n``, :mod:`isbflow.isb.redis.keys`).
The partition is **lost** when:

- its incarnation is missing (flushed, restarted without persistence, keys deleted): a reader that
  saw one never meets an empty buffer instead;
- its incarnation changed (wiped, then made again by a writer or by provisioning);
- its last offset is below what the reader read: the server holds less than it once did
  (a failover to a replica behind its master);
- entries were removed that no release removed (``entries-added - length - released > 0``: a
  trim or delete outside isbflow) and the stream's head has moved past the reader's offset. This
  errs on the safe side: removals of entries read but not yet committed downstream count too (the
  downstream would need them after a restart).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from isbflow.isb.redis.keys import offset_of
from isbflow.isb.store import Incarnation, Loss, ReaderPosition


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass(frozen=True)
class BufferState:
    """One partition at one instant (read by :data:`isbflow.isb.redis.scripts.STATE`)."""

    incarnation: Incarnation | None
    #: entries removed by releases, and the highest offset released
    released: int
    released_to: int
    #: the stream's entries now, ever added, its first entry's offset (None: empty) and its last
    #: generated offset (0: none yet)
    length: int
    entries_added: int
    first: int | None
    last_generated: int
    #: frame ids in the dedup index
    ids: int

    @classmethod
    def of(cls, inc: dict[bytes, Any], info: dict[bytes, Any] | None, ids: int) -> BufferState:
        """From the incarnation hash and the stream's fields (None: no stream key), as
        :data:`isbflow.isb.redis.scripts.STATE` reads them."""
        incarnation = (Incarnation(_text(inc[b"id"]), int(inc.get(b"created", 0)) / 1000)
                       if b"id" in inc else None)
        info = info or {}
        first = info.get(b"first-entry")
        return cls(incarnation, int(inc.get(b"released", 0)), int(inc.get(b"released_to", 0)),
                   int(info.get(b"length", 0)), int(info.get(b"entries-added", 0)),
                   offset_of(first) if first else None, offset_of(info.get(b"last-generated-id", b"0-0")), ids)

    @property
    def unreleased_removals(self) -> int:
        """Entries that left the stream without a release."""
        return self.entries_added - self.length - self.released


def judge(stream: str, state: BufferState, seen: ReaderPosition[int]) -> Loss[int] | None:
    """The loss a reader at ``seen`` suffered on ``stream`` in ``state`` (module doc), or None."""
    after = (seen.read_to or 0) + 1
    if state.incarnation is None:
        return Loss(stream, "its incarnation is gone: the keys were flushed (FLUSHALL), evicted or deleted, or the "
                            "server restarted without persistence", after)
    if state.incarnation.id != seen.incarnation:
        return Loss(stream, f"it was recreated (incarnation {seen.incarnation} is gone, now "
                            f"{state.incarnation.id})", after)
    if seen.read_to is not None and state.last_generated < seen.read_to:
        return Loss(stream, f"it holds less than was read: its last offset {state.last_generated} is below "
                            f"{seen.read_to}, read before (a failover to a replica behind its master)",
                    state.last_generated + 1)
    head = state.first if state.first is not None else state.last_generated + 1
    if state.unreleased_removals > 0 and (seen.read_to is None or head > seen.read_to):
        return Loss(stream, f"{state.unreleased_removals} entries were removed that no release freed (trimmed or "
                            "deleted outside isbflow) and its first entry moved past the offset read",
                    max(after, state.released_to + 1))
    return None
