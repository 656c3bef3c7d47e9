"""The dead-letter buffer on Redis: one stream per pipeline (``naming.dlq_stream``), a letter per
entry.

A letter's body is the JSON :mod:`isbflow.isb.dlq` encodes (``reason``, ``step``, ``origin``,
``size``, ``truncated``, ``record``): everything JetStream keeps in the letter's headers is in the
body too, so an entry holds the body only. Letters are written through the same idempotent write
as frames (:meth:`isbflow.isb.redis.buffers.RedisBuffer.write`): a letter with a deterministic id
(a re-executed Spark batch writes the same letter again) is stored once; a letter without one gets
a random id. Nothing releases the dead-letter stream: a letter stays until an operator removes it
(bounded at :data:`DEFAULT_CAPACITY` letters: a full one refuses the letter with
:class:`isbflow.isb.store.BufferFull` and the step fails, rather than a letter vanishing).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from isbflow.isb.redis.buffers import RedisBuffer
from isbflow.isb.store import BufferFull, OutFrame

#: entries per read call
READ_LETTERS = 512
#: the most letters a pipeline's dead-letter stream keeps (JetStream's default ``bufferConfig.deadLetter.maxMsgs``):
#: a full one refuses the next letter, and the step fails loudly rather than a letter vanishing
DEFAULT_CAPACITY = 100_000


class RedisDeadLetters:
    """A pipeline's dead-letter stream on a ``redis.asyncio`` client (module doc)."""

    def __init__(self, client: Any, *, capacity: int | None = DEFAULT_CAPACITY):
        self.client, self.capacity = client, capacity

    async def publish(self, stream: str, letters: Sequence[tuple[str | None, bytes]]) -> int:
        """Store ``letters`` (``(id or None, JSON body)``) in order; how many were stored anew
        (a letter id stored before is not counted). Raises :class:`isbflow.isb.store.BufferFull`
        when the stream holds its capacity."""
        frames = [OutFrame(letter_id or f"dlq:{uuid.uuid4().hex}", body, 1) for letter_id, body in letters]
        written = await RedisBuffer(self.client, stream, capacity=self.capacity).write(frames)
        return sum(not w.duplicate for w in written)

    async def read(self, stream: str, step: str | None = None, limit: int = 100_000) -> list[tuple[int, dict]]:
        """``(offset, letter)`` of the stream's letters, oldest first, of ``step`` only when given;
        at most ``limit``."""
        buf, after, out = RedisBuffer(self.client, stream), None, []
        while len(out) < limit:
            frames = await buf.read(after, None, READ_LETTERS)
            if not frames:
                break
            for f in frames:
                letter = json.loads(f.payload or b"{}")
                if step is None or letter.get("step") == step:
                    out.append((f.offset, letter))
                    if len(out) >= limit:
                        break
            after = frames[-1].offset
        return out


__all__ = ["BufferFull", "RedisDeadLetters"]
