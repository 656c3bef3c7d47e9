"""The roles a buffer store plays, as interfaces every store implements in its own package.

An inter-step buffer (ISB) partition is an append-only log of *frames* (Arrow IPC batches,
:mod:`isbflow.isb.frames`) between two steps. A store keeps those logs: JetStream (a partition is
a stream, offsets are sequences) or Redis Streams (:mod:`isbflow.isb.redis`: a partition is a
stream key, offsets are entry ids). The layers above talk to the roles below, never to a store's
client, so adding a store touches no caller; a store imports no other store.

Delivery guarantee, whatever the store: a frame written under a frame id
(:func:`isbflow.isb.frames.frame_id`) is stored **once** however often it is written again before
its release (a retried task, a re-executed Spark batch, a fresh writer after a crash between the
write and the upstream commit); reads never remove anything, so reading a range twice returns the
same frames; space is released only after the *downstream* commit; and a buffer that lost frames
its reader had not yet read says so (:class:`LossDetector`) instead of looking empty. Together
with replay from the source's offsets that makes the pipeline's output exactly once.

Offsets are integers in every store, from 1, in the store's log order: JetStream's stream
sequences, and Redis entry ids ``0-<n>`` (a Redis buffer appends with ``0-*``, so entry ``0-<n>`` is
offset ``n``). The ledger, the checkpoints and recovery compare offsets the same way whichever
store gave them; a caller never does arithmetic across two incarnations of a buffer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

#: a store's offset type: totally ordered like the store's log
Offset = TypeVar("Offset")


class BufferFull(Exception):
    """A write the buffer refused because it holds its capacity of frames not yet released.

    The caller retries later (``onFull=retryUntilSuccess``: back-pressure, :func:`write_until_stored`)
    or drops and counts the frame (``discardLatest``). ``stored`` holds the outcome of each frame of
    the refused call that went in before the refusal, in order (``written`` of them); none after it
    did."""

    def __init__(self, stream: str, capacity: int, stored: Sequence[Written] = ()):
        super().__init__(stream, capacity, len(stored))
        self.stream, self.capacity, self.stored = stream, capacity, list(stored)

    @property
    def written(self) -> int:
        return len(self.stored)

    def __str__(self) -> str:
        return (f"buffer {self.stream} is full: it holds {self.capacity} frames not yet committed downstream "
                f"({self.written} frames of this write were stored); write the rest again once the downstream "
                "step commits and releases them")


class BufferMissing(LookupError):
    """A write to a partition that does not exist: never provisioned, or lost (deleted, flushed,
    the server restarted empty). The store does not make it again: its readers would take the new
    partition for the old one and never see what the lost one held."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.stream = stream

    def __str__(self) -> str:
        return (f"buffer {self.stream} does not exist on the ISB service: provision the pipeline "
                "('isbflow isb apply'), or recover it after a loss ('isbflow replay --mode recover')")


@dataclass(frozen=True)
class OutFrame:
    """A frame to write: its id (stable across retries), its bytes and its record count."""

    frame_id: str
    payload: bytes
    rows: int


@dataclass(frozen=True)
class Written(Generic[Offset]):
    """The outcome of one frame's write: where it is stored, or that an earlier write stored it."""

    frame_id: str
    #: the frame's offset; None for a duplicate when the store does not say where the first one is
    offset: Offset | None
    duplicate: bool


@dataclass(frozen=True)
class StoredFrame(Generic[Offset]):
    """A frame as read back: its offset, id, bytes, record count and when the store wrote it
    (milliseconds since the epoch, by the store's clock; 0 when the store does not say)."""

    offset: Offset
    frame_id: str
    payload: bytes
    rows: int
    written_ms: int = 0


@dataclass(frozen=True)
class Incarnation:
    """Which life of a buffer this is: a new id whenever the buffer is created again (recreated,
    flushed, restarted without persistence), and when that was (seconds since the epoch)."""

    id: str
    created: float


@dataclass(frozen=True)
class StreamState:
    """What the driver needs to know about one buffer partition (JetStream: from ``STREAM.INFO``;
    Redis: the stream and its incarnation, with ``retention`` ``interest`` and no direct get)."""

    name: str
    #: the stream's creation time as the server reports it (RFC 3339, ns): identifies
    #: this incarnation; a deleted and recreated stream has a new one.
    incarnation: str
    first_seq: int
    last_seq: int
    messages: int
    retention: str
    allow_direct: bool


def has_buffer_role(conn: Any) -> bool:
    """Whether ``conn`` is a store object with its own buffer role (``conn.buffer(stream)``: Redis),
    not a nats-py client, whose buffers are JetStream streams."""
    return callable(getattr(conn, "buffer", None))


def incarnation_gone(st: StreamState | None, incarnation: str) -> str | None:
    """Why a partition read as ``incarnation`` is lost (its state now ``st``: None when it no longer
    exists), or None when it still is that incarnation."""
    if st is None:
        return "the stream no longer exists"
    if st.incarnation != incarnation:
        return f"the stream was recreated (incarnation {incarnation} is gone, now {st.incarnation})"
    return None


#: One message as read: (offset, payload, headers, store time). JetStream: the time is the
#: ``Nats-Time-Stamp`` string (RFC 3339, ns) on the direct-get path and integer nanoseconds since
#: the epoch on the consumer path (one chunk holds one kind); Redis: integer milliseconds, and the
#: headers hold the frame's id and rows (:mod:`isbflow.isb.frames`).
Message = tuple[int, bytes, dict, "str | int"]


@dataclass(frozen=True)
class BufferInfo:
    """A buffer partition's state at one instant, in integer offsets (JetStream's stream
    sequences; Redis entry ids ``0-<n>``): the first offset held (``last + 1`` when it holds none),
    the last offset ever written (0 when none), how many frames it holds, and its incarnation."""

    stream: str
    incarnation: str
    first: int
    last: int
    messages: int


@dataclass(frozen=True)
class ReaderPosition(Generic[Offset]):
    """What a reader has seen of a buffer: the incarnation and the last offset it read."""

    incarnation: str
    read_to: Offset | None


@dataclass(frozen=True)
class Loss(Generic[Offset]):
    """A buffer found to have lost frames its reader had not read: why, and the lost offsets
    (``first``/``last`` None when the store cannot say)."""

    stream: str
    reason: str
    first: Offset | None = None
    last: Offset | None = None


class BufferWriter(Protocol[Offset]):
    """Writes frames into one buffer partition, idempotently."""

    stream: str

    async def write(self, frames: Sequence[OutFrame]) -> list[Written[Offset]]:
        """Append ``frames`` in order; a frame id the buffer already holds (or released within the
        store's dedup window) is reported ``duplicate`` and appended nothing. Raises
        :class:`BufferFull` at capacity, having stored the frames before the refused one (its
        ``written``) and none after it, so a retry of the rest keeps the order. Any other error
        leaves an unknown prefix stored: writing the same frames again is always safe."""
        ...


class BufferReader(Protocol[Offset]):
    """Reads ranges of one buffer partition without removing anything."""

    stream: str

    async def read(self, after: Offset | None, upto: Offset | None, limit: int,
                   incarnation: str | None = None) -> list[StoredFrame[Offset]]:
        """At most ``limit`` frames with ``after < offset <= upto`` (``None``: from the first, to the
        last), in offset order. The same range read twice gives the same frames. With
        ``incarnation``, raises :class:`isbflow.isb.errors.BufferLost` when the buffer is no longer
        that incarnation (its frames are another life's)."""
        ...


class LossDetector(Protocol[Offset]):
    """Tells buffer loss from an empty buffer."""

    stream: str

    async def incarnation(self) -> Incarnation | None:
        """The buffer's current incarnation; None when it has none (never created, or wiped)."""
        ...

    async def check(self, seen: ReaderPosition[Offset]) -> Loss[Offset] | None:
        """The loss a reader at ``seen`` suffered, or None: the incarnation is gone or changed,
        frames it had not read were removed without a release, or the buffer holds less than it
        already read (a failover to a replica behind its master)."""
        ...


class BufferReleaser(Protocol[Offset]):
    """Frees a buffer's space once the downstream commit covers it."""

    stream: str

    async def release(self, upto: Offset, incarnation: str | None = None) -> int:
        """Remove the frames with offset ``<= upto`` (called only after the downstream commit that
        covers them; never by the reader); how many were removed. Idempotent. With
        ``incarnation``, removes nothing when the buffer has since become another incarnation."""
        ...


class BucketMissing(LookupError):
    """A key-value bucket the store does not have (JetStream: never provisioned or deleted)."""

    def __init__(self, bucket: str):
        super().__init__(bucket)
        self.bucket = bucket

    def __str__(self) -> str:
        return f"key-value bucket {self.bucket} does not exist: provision the pipeline's ISB service first"


class ValueTooLarge(ValueError):
    """A value larger than the store takes in one key (JetStream: the server's ``max_payload``)."""

    def __init__(self, bucket: str, key: str, size: int, limit: int):
        super().__init__(bucket, key, size, limit)
        self.bucket, self.key, self.size, self.limit = bucket, key, size, limit

    def __str__(self) -> str:
        return f"{self.bucket}/{self.key}: a value of {self.size} bytes is over the store's limit of {self.limit}"


class KeyValue(Protocol):
    """One key-value bucket: the control (desired state), status, ledger and reference-table
    stores are buckets (:mod:`isbflow.isb.naming`). Keys are dot-separated words; values bytes."""

    bucket: str
    #: the largest value :meth:`put` takes, in bytes
    max_value: int

    async def get(self, key: str) -> bytes | None:
        """The key's value; None when it has none (never put, or deleted)."""
        ...

    async def put(self, key: str, value: bytes) -> None:
        """Set the key's value (last writer wins). Raises :class:`ValueTooLarge` over :attr:`max_value`."""
        ...

    async def delete(self, key: str) -> None:
        """Remove the key's value; a key without one is left as it is."""
        ...

    async def keys(self) -> list[str]:
        """Every key holding a value, sorted."""
        ...

    async def items(self) -> dict[str, bytes]:
        """Every key holding a value, with its value."""
        ...

    async def add(self, key: str, n: int) -> int:
        """Add ``n`` to the integer the key holds (0 when it has none), atomically against other
        adders; the new value."""
        ...


class ControlStore(Protocol):
    """Where a store keeps its key-value buckets."""

    async def kv(self, bucket: str) -> KeyValue:
        """The bucket; raises :class:`BucketMissing` when the store requires buckets to be made
        first (JetStream) and this one was not."""
        ...


async def write_until_stored(writer: BufferWriter[Offset], frames: Sequence[OutFrame], *, first_pause: float = 0.05,
                             max_pause: float = 2.0,
                             on_full: Callable[[BufferFull], None] | None = None) -> list[Written[Offset]]:
    """``onFull=retryUntilSuccess`` over any store: write ``frames``; while the buffer is full, wait
    (pauses doubling from ``first_pause`` up to ``max_pause``; ``on_full`` hears each refusal, e.g.
    to log it) and write the rest again, until every frame is stored, in order. Back-pressure: the
    caller is held as long as the downstream step has not committed and released."""
    out: list[Written[Offset]] = []
    rest, pause = list(frames), first_pause
    while True:
        try:
            return out + await writer.write(rest)
        except BufferFull as full:
            out += full.stored
            rest = rest[full.written:]
            if on_full is not None:
                on_full(full)
            await asyncio.sleep(pause)
            pause = min(pause * 2, max_pause)

