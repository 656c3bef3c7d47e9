"""The buffer role of :mod:`isbflow.isb.buffers` on Redis: what the steps, recovery and the faces
do with a Redis store's partitions, in the shapes they already use for JetStream.

- :meth:`RedisBuffers.state`: a :class:`isbflow.isb.store.StreamState` from the partition's stream
  and incarnation (``retention`` ``interest``: frames leave only when released after the
  downstream commit; no direct get);
- :meth:`RedisBuffers.read_range`: the messages of an offset range, in chunks of at most
  :data:`READ_FRAMES` entries, each a :data:`isbflow.isb.store.Message` whose headers carry the
  frame's format, rows and id, as a JetStream frame's do (:mod:`isbflow.isb.frames`), and whose
  time is the write's, in nanoseconds since the epoch (an event's ``_isb_ts``). A missing
  offset inside the range is a gap: :class:`isbflow.isb.errors.BufferLost`, or reported to
  ``on_gap`` and skipped;
- :meth:`RedisBuffers.wait_for_append`: one ``XREAD BLOCK`` over the partitions, from the last
  offset each reader has seen, in slices so a drain or stop is heard within :data:`CHECK_EVERY`;
- :meth:`RedisBuffers.release`: :meth:`isbflow.isb.redis.buffers.RedisBuffer.release`, nothing
  under ``limits`` retention (keep everything) or once the partition is another incarnation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from isbflow.isb.errors import BufferLost
from isbflow.isb.frames import FRAME_FORMAT, HDR_FRAME, HDR_ROWS
from isbflow.isb.redis.buffers import RedisBuffer
from isbflow.isb.redis.keys import BufferKeys, EntryId
from isbflow.isb.store import Message, StreamState

#: entries per read call: a call blocks the server while it runs, and a chunk is held in memory
READ_FRAMES = 32
#: seconds between looks at ``cancelled`` while waiting for an append
CHECK_EVERY = 0.5
#: the header naming the frame's id (JetStream's ``Nats-Msg-Id`` holds the same id)
HDR_FRAME_ID = "Isb-Frame-Id"


def _retention_kind(retention: object) -> str:
    return str(getattr(retention, "value", retention)).lower()


class RedisBuffers:
    """:class:`isbflow.isb.buffers.Buffers` on a ``redis.asyncio`` client (module doc)."""

    def __init__(self, client: Any, *, read_frames: int = READ_FRAMES):
        self.client, self.read_frames = client, read_frames

    async def state(self, stream: str) -> StreamState | None:
        info = await RedisBuffer(self.client, stream).state()
        if info is None:
            return None
        return StreamState(name=stream, incarnation=info.incarnation, first_seq=info.first, last_seq=info.last,
                           messages=info.messages, retention="interest", allow_direct=False)

    async def read_range(self, stream: str, first: int, last: int, *,
                         on_gap: Callable[[int, int], None] | None = None, **_: Any) -> AsyncIterator[list[Message]]:
        buf = RedisBuffer(self.client, stream)
        expected, after = first, first - 1

        def gap(a: int, b: int) -> None:
            if on_gap is None:
                raise BufferLost(stream, a, b, "the messages were removed from the stream before they were read "
                                                 "(released, flushed or trimmed)")
            on_gap(a, b)

        while after < last:
            frames = await buf.read(after, last, self.read_frames)
            if not frames:
                break
            chunk: list[Message] = []
            for f in frames:
                if f.offset > expected:
                    gap(expected, f.offset - 1)
                chunk.append((f.offset, f.payload, {HDR_FRAME: FRAME_FORMAT, HDR_ROWS: str(f.rows),
                                                    HDR_FRAME_ID: f.frame_id}, f.written_ms * 1_000_000))
                expected = f.offset + 1
            after = frames[-1].offset
            yield chunk
        if expected <= last:
            gap(expected, last)

    async def wait_for_append(self, after: Mapping[str, int], timeout: float,
                              cancelled: Callable[[], bool] = lambda: False) -> bool:
        if not after:
            return False
        streams = {BufferKeys(s).stream: str(EntryId.of(max(0, int(n)))) for s, n in after.items()}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            if left <= 0 or cancelled():
                return False
            block_ms = max(1, int(min(CHECK_EVERY, left) * 1000))
            got = await self.client.xread(streams, count=1, block=block_ms)
            if got:
                return True

    async def release(self, stream: str, upto: int, retention: object, incarnation: str | None = None) -> int:
        if _retention_kind(retention) == "limits" or upto < 1:
            return 0
        return await RedisBuffer(self.client, stream).release(upto, incarnation)
