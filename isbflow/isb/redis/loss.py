"""Loss detection on Redis: is a partition gone, recreated, trimmed or behind what its reader read?

Redis can lose a buffer in ways an empty stream would hide: ``FLUSHALL``, a restart without
persistence (or with an AOF that missed its last second), eviction, or a failover to a replica
that had not received the master's last writes. So every partition has an incarnation
(:mod:`isbflow.isb.redis.keys`), made with the partition and counting what releases removed.
:func:`judge` compares it and the stream's own counters (``XINFO STREAM``: ``entries-added``,
``length``, first entry, ``last-generated-id``) with what the reader has seen
(:class:`isbflow.isb.store.ReaderPosition`: the incarnation and the last entry id it read).
The partition is **lost** when:

- its incarnation is missing (flushed, restarted without persistence, keys deleted): a reader that
  saw one never meets an empty buffer instead;
- its incarnation changed (wiped, then made again by a writer or by provisioning);
- its last generated id is below what the reader read: the server holds less than it once did
  (a failover to a replica behind its master);
- entries were removed that no release removed (``entries-added - length - released > 0``: a
  trim or delete outside isbflow) and the stream's head has moved past the reader's offset. Entry
  ids are not consecutive, so this errs on the safe side: removals of entries read but not yet
  committed downstream count too (the downstream would need them after a restart).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from isbflow.isb.redis.keys import ZERO, EntryId
from isbflow.isb.store import Incarnation, Loss, ReaderPosition


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass(frozen=True)
class BufferState:
    """One partition at one instant (read by :data:`isbflow.isb.redis.scripts.STATE`)."""

    incarnation: Incarnation | None
    #: entries removed by releases, and the highest entry id released
    released: int
    released_to: EntryId
    #: the stream's entries now, ever added, its first entry (None: empty) and last generated id
    length: int
    entries_added: int
    first: EntryId | None
    last_generated: EntryId
    #: frame ids in the dedup index
    ids: int

    @classmethod
    def of(cls, inc: dict[bytes, Any], info: dict[bytes, Any] | None, ids: int) -> BufferState:
        """From the incarnation hash and ``XINFO STREAM``'s fields (None: no stream key)."""
        incarnation = (Incarnation(_text(inc[b"id"]), int(inc.get(b"created", 0)) / 1000)
                       if b"id" in inc else None)
        info = info or {}
        first = info.get(b"first-entry")
        return cls(incarnation, int(inc.get(b"released", 0)), EntryId.parse(inc.get(b"released_to", b"0-0")),
                   int(info.get(b"length", 0)), int(info.get(b"entries-added", 0)),
                   EntryId.parse(first[0]) if first else None,
                   EntryId.parse(info.get(b"last-generated-id", b"0-0")), ids)

    @property
    def unreleased_removals(self) -> int:
        """Entries that left the stream without a release."""
        return self.entries_added - self.length - self.released


def judge(stream: str, state: BufferState, seen: ReaderPosition[EntryId]) -> Loss[EntryId] | None:
    """The loss a reader at ``seen`` suffered on ``stream`` in ``state`` (module doc), or None."""
    after = (seen.read_to or ZERO).after()
    if state.incarnation is None:
        return Loss(stream, "its incarnation is gone: the keys were flushed (FLUSHALL), evicted or deleted, or the "
                            "server restarted without persistence", after)
    if state.incarnation.id != seen.incarnation:
        return Loss(stream, f"it was recreated (incarnation {seen.incarnation} is gone, now "
                            f"{state.incarnation.id})", after)
    if seen.read_to is not None and state.last_generated < seen.read_to:
        return Loss(stream, f"it holds less than was read: its last entry id {state.last_generated} is below "
                            f"{seen.read_to}, read before (a failover to a replica behind its master)",
                    state.last_generated.after())
    head = state.first if state.first is not None else state.last_generated.after()
    if state.unreleased_removals > 0 and (seen.read_to is None or head > seen.read_to):
        return Loss(stream, f"{state.unreleased_removals} entries were removed that no release freed (trimmed or "
                            "deleted outside isbflow) and its first entry moved past the offset read",
                    max(after, state.released_to.after()))
    return None
