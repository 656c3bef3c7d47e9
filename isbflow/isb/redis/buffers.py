"""One buffer partition on Redis Streams: the writer, range reader, loss detector and releaser of
:mod:`isbflow.isb.store`, in one class (a role's user calls only its role's methods, and the ACL of
:mod:`isbflow.isb.redis.acl` lets it call no more).

- **Write** (:meth:`RedisBuffer.write`): frames go in calls of at most :data:`CALL_FRAMES`
  frames and :data:`CALL_BYTES` bytes, each one run of :data:`isbflow.isb.redis.scripts.WRITE`:
  a frame whose id the dedup index holds is a duplicate and appends nothing; otherwise it is
  appended at the next integer offset (entry ``0-<n>``, :mod:`isbflow.isb.redis.keys`) and its
  id recorded, in the same step. The ids stay in the index until their frames are released *and*
  ``dedup_window`` seconds old (JetStream's duplicates window, default two minutes), so a fresh
  writer re-sending a batch after a crash stores nothing twice.
- **Back-pressure**: with a ``capacity``, a frame is refused while the stream holds that many
  entries (entries leave only by release, i.e. once committed downstream):
  :class:`isbflow.isb.store.BufferFull`, after the frames before it were stored.
- **A partition that does not exist** (never provisioned, or lost: deleted, flushed, restarted
  empty): a pipeline's writers (``create_missing=False``) are refused with
  :class:`isbflow.isb.store.BufferMissing`, as JetStream refuses a publish no stream stores, so a
  writer never makes a lost partition again behind the back of a reader that had not yet read what
  it held; provisioning and recovery make it (:meth:`RedisBuffer.create`). Other writers (the
  dead-letter stream) make its incarnation on their first write.
- **Read** (:meth:`RedisBuffer.read`): ``XRANGE`` of an offset range, at most ``limit`` entries,
  with the incarnation read in the same step; nothing is removed.
- **Release** (:meth:`RedisBuffer.release`): ``XTRIM MINID`` past ``upto``, the count recorded with
  the incarnation (so removals nobody released are told apart), and the dedup index trimmed.
- **Loss** (:meth:`RedisBuffer.check`): :func:`isbflow.isb.redis.loss.judge` on the state.
- **State** (:meth:`RedisBuffer.state`): first and last offsets, entries held and incarnation, as
  :class:`isbflow.isb.store.BufferInfo` (JetStream's stream state, in the same integers).

Offsets are ``int`` at every method; :class:`isbflow.isb.redis.keys.EntryId` is only the wire form.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from isbflow.isb.errors import BufferLost
from isbflow.isb.redis import scripts
from isbflow.isb.redis.keys import BufferKeys, EntryId, offset_of
from isbflow.isb.redis.loss import BufferState, judge
from isbflow.isb.store import (
    BufferFull,
    BufferInfo,
    BufferMissing,
    Incarnation,
    Loss,
    OutFrame,
    ReaderPosition,
    StoredFrame,
    Written,
)

#: most frames, and bytes of frames, per script call (a call blocks the server while it runs)
CALL_FRAMES = 64
CALL_BYTES = 4 * 1024 * 1024
#: seconds a released frame's id still deduplicates (JetStream's default duplicates window)
DEDUP_WINDOW = 120.0


def capacity(buffer_max_length: int, buffer_usage_limit: float, frame_rows: int = 1) -> int:
    """Entries a partition may hold before writes are refused: ``bufferMaxLength x bufferUsageLimit``
    records, counted in frames of ``frame_rows`` records as the JetStream writer counts them
    (``frame_rows=1``: one record per entry)."""
    if buffer_max_length < 1 or not 0 < buffer_usage_limit <= 1 or frame_rows < 1:
        raise ValueError(f"bufferMaxLength {buffer_max_length} must be >= 1, bufferUsageLimit "
                         f"{buffer_usage_limit} in (0, 1] and frame rows {frame_rows} >= 1")
    return max(1, -(-int(buffer_max_length * buffer_usage_limit) // frame_rows))


@dataclass(frozen=True)
class BufferSizes:
    """How much one partition holds: entries in the stream, ids in its dedup index."""

    entries: int
    ids: int


def _fields(flat: Sequence[Any]) -> dict[bytes, Any]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RedisBuffer:
    """One partition stream on a ``redis.asyncio`` client (module doc). ``capacity``: entries the
    stream may hold before writes are refused (None: unbounded; see :func:`capacity`)."""

    def __init__(self, client: Any, stream: str, *, capacity: int | None = None,
                 dedup_window: float = DEDUP_WINDOW, create_missing: bool = True):
        if capacity is not None and capacity < 1:
            raise ValueError(f"buffer {stream}: capacity {capacity} must be >= 1 (or None: unbounded)")
        self.client = client
        self.stream = stream
        self.keys = BufferKeys(stream)
        self.capacity = capacity
        self.dedup_window = dedup_window
        #: a write makes the incarnation when there is none; False (a pipeline's writers): it is refused
        self.create_missing = create_missing

    # -- create / delete (the admin's)
    async def create(self) -> str:
        """Make the partition's incarnation when it has none (provisioning); its id."""
        return _text(await scripts.run(self.client, scripts.CREATE, self.keys.all, [secrets.token_hex(8)]))

    async def created(self) -> bool:
        """Whether the partition has an incarnation (provisioned or written), asked with ``EXISTS``
        only: a producer, which may read nothing of a stream (:mod:`isbflow.isb.redis.acl`), can ask."""
        return bool(await self.client.exists(self.keys.incarnation))

    async def delete(self) -> None:
        """Remove the partition's keys (its frames, ids and incarnation)."""
        await self.client.delete(*self.keys.all)

    # -- BufferWriter
    async def write(self, frames: Sequence[OutFrame]) -> list[Written[int]]:
        """Append ``frames`` in order, idempotently (:meth:`isbflow.isb.store.BufferWriter.write`)."""
        out: list[Written[int]] = []
        start = 0
        while start < len(frames):
            end, size = start + 1, len(frames[start].payload)
            while end < len(frames) and end - start < CALL_FRAMES and size + len(frames[end].payload) <= CALL_BYTES:
                size += len(frames[end].payload)
                end += 1
            args: list[Any] = [secrets.token_hex(8) if self.create_missing else "", self.capacity or 0]
            for f in frames[start:end]:
                args += [f.frame_id, f.rows, f.payload]
            replies = await scripts.run(self.client, scripts.WRITE, self.keys.all, args)
            for f, reply in zip(frames[start:end], replies, strict=False):
                r = _text(reply)
                if r == "missing":
                    raise BufferMissing(self.stream)
                if r == "full":
                    raise BufferFull(self.stream, self.capacity or 0, stored=out)
                out.append(Written(f.frame_id, None, True) if r == "dup"
                           else Written(f.frame_id, offset_of(r), False))
            start = end
        return out

    # -- BufferReader
    async def read(self, after: int | None, upto: int | None, limit: int,
                   incarnation: str | None = None) -> list[StoredFrame[int]]:
        """At most ``limit`` frames with ``after < offset <= upto`` (:meth:`isbflow.isb.store.BufferReader.read`)."""
        if limit < 1:
            return []
        start = "-" if after is None else f"({EntryId.of(after)}"
        end = "+" if upto is None else str(EntryId.of(upto))
        inc, entries = await scripts.run(self.client, scripts.READ, self.keys.all, [start, end, limit])
        if incarnation is not None and (inc is None or _text(inc) != incarnation):
            first = (after or 0) + 1
            why = ("its incarnation is gone (the keys were flushed, or the server restarted without persistence)"
                   if inc is None else f"it was recreated (incarnation {incarnation} is gone, now {_text(inc)})")
            raise BufferLost(self.stream, first, None, why)
        frames = []
        for entry_id, flat in entries:
            f = _fields(flat)
            frames.append(StoredFrame(offset_of(entry_id), _text(f.get(b"id", b"")), bytes(f.get(b"f", b"")),
                                      int(f.get(b"rows", 0)), int(f.get(b"t", 0))))
        return frames

    # -- BufferReleaser
    async def release(self, upto: int, incarnation: str | None = None) -> int:
        """Remove the frames with offset ``<= upto`` (:meth:`isbflow.isb.store.BufferReleaser.release`)."""
        n = await scripts.run(self.client, scripts.RELEASE, self.keys.all,
                              [int(upto), incarnation or "", int(self.dedup_window * 1000)])
        return max(0, int(n))

    # -- LossDetector
    async def snapshot(self) -> BufferState:
        """The partition's incarnation, stream counters and dedup index size, read in one step."""
        inc, info, ids = await scripts.run(self.client, scripts.STATE, self.keys.all, [])
        return BufferState.of(_fields(inc), _fields(info) if info else None, int(ids))

    async def incarnation(self) -> Incarnation | None:
        return (await self.snapshot()).incarnation

    async def check(self, seen: ReaderPosition[int]) -> Loss[int] | None:
        """The loss a reader at ``seen`` suffered (:func:`isbflow.isb.redis.loss.judge`), or None."""
        return judge(self.stream, await self.snapshot(), seen)

    async def state(self) -> BufferInfo | None:
        """First and last offset, entries held and incarnation (:class:`isbflow.isb.store.BufferInfo`);
        None when the partition has no incarnation (never created or written, or wiped)."""
        st = await self.snapshot()
        if st.incarnation is None:
            return None
        first = st.first if st.first is not None else st.last_generated + 1
        return BufferInfo(self.stream, st.incarnation.id, first, st.last_generated, st.length)

    async def sizes(self) -> BufferSizes:
        """Entries in the stream and ids in the dedup index (both bounded by releases)."""
        st = await self.snapshot()
        return BufferSizes(st.length, st.ids)
