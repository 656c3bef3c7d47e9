"""The dead-letter buffer: records a step could not pass on, one JSON message each.

A record that cannot travel on an edge (today: one that alone exceeds the
server's ``max_payload``, see :func:`isbflow.isb.frames.split_frames`) is not
dropped and does not fail the query: it goes to the pipeline's dead-letter
stream (``naming.dlq_stream(pipeline)``, subjects ``isb.<pipeline>.dlq.>``,
created by provisioning) on ``naming.dlq_subject(pipeline, vertex)``, and the
rest of the batch flows on.

The dead-letter stream's settings are its own: ``bufferConfig.deadLetter`` of the
ISB service (:class:`isbflow.spec.models.DeadLetterConfig`; by default file storage,
Limits retention, 100,000 letters, 256MiB, 7 days), never the buffers'
``bufferConfig.stream``. When bounded it refuses new letters once full (discard
``new``): the publish fails and the step with it, rather than a letter vanishing.

Format of one dead letter (one NATS message):

- headers ``Isb-Reason`` (one line, at most 512 chars), ``Isb-Step`` (the
  vertex that rejected it), ``Isb-Origin`` (the record's ``_isb_id`` when it
  has one, else empty), and ``Nats-Msg-Id`` when the caller gives a
  deterministic id (a re-executed Spark batch then adds no duplicate);
- body: JSON ``{"reason", "step", "origin", "size", "truncated", "record"}``
  where ``size`` is the record's size in bytes where it failed and ``record``
  is the record as a JSON object, or, when that would make the message larger
  than ``min(max_payload, MAX_LETTER_BYTES)``, a prefix of the record's JSON
  text with ``"truncated": true``. A dead letter is never larger than
  ``max_payload``.

Values JSON cannot hold are written as text: bytes as base64, dates and
timestamps in ISO 8601, decimals as strings.
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nats.js.errors import NoStreamResponseError, NotFoundError

from isbflow.isb import naming
from isbflow.isb.connect import NatsSettings, run_with, session
from isbflow.isb.control import kv as open_kv
from isbflow.isb.errors import BufferReadError
from isbflow.isb.frames import HEADER_ROOM, payload_digest
from isbflow.isb.store import BucketMissing

if TYPE_CHECKING:
    import nats.js

HDR_REASON = "Isb-Reason"
HDR_STEP = "Isb-Step"
HDR_ORIGIN = "Isb-Origin"
#: Largest dead letter written, whatever the server allows: enough to diagnose, not a second copy of big data.
MAX_LETTER_BYTES = 64 * 1024
_MAX_HEADER_CHARS = 512
_ACK_TIMEOUT = 10.0


class DeadLetterBufferNotFound(Exception):
    """No stream stores the dead-letter subject (the pipeline is not provisioned)."""

    def __init__(self, pipeline: str, subject: str):
        super().__init__(pipeline, subject)
        self.pipeline, self.subject = pipeline, subject

    def __str__(self) -> str:
        return (f"the dead-letter buffer {naming.dlq_stream(self.pipeline)} does not store {self.subject}: "
                "provision the pipeline ('isbflow isb apply'); records that could not be passed on "
                "are kept there")


@dataclass(frozen=True)
class DeadLetter:
    """One record on its way to the dead-letter buffer."""

    record: dict
    reason: str
    #: bytes the record took where it failed (e.g. its Arrow encoding); its JSON size when None
    size: int | None = None
    #: deterministic ``Nats-Msg-Id`` so a retried task's letter is dropped as a duplicate (the
    #: body's digest is appended: only the same letter counts as a duplicate)
    msg_id: str | None = None


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()
    if isinstance(value, _dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    return str(value)


def _header_text(text: str) -> str:
    return " ".join(str(text).split())[:_MAX_HEADER_CHARS]


def encode_dead_letter(letter: DeadLetter, step: str, max_payload: int) -> tuple[dict[str, str], bytes]:
    """Headers and body of one dead letter, the body at most ``min(max_payload, MAX_LETTER_BYTES)``
    less header room. Pure."""
    budget = min(max_payload - HEADER_ROOM, MAX_LETTER_BYTES)
    if budget < 256:
        raise ValueError(f"max_payload {max_payload} leaves no room for a dead letter")
    origin = letter.record.get("_isb_id")
    origin = "" if origin is None else str(origin)
    record_text = json.dumps(letter.record, default=_json_default, separators=(",", ":"))
    envelope = {
        "reason": letter.reason[:4096],
        "step": step,
        "origin": origin[:1024],
        "size": letter.size if letter.size is not None else len(record_text.encode()),
        "truncated": False,
        "record": json.loads(record_text),
    }
    body = json.dumps(envelope, separators=(",", ":")).encode()
    if len(body) > budget:
        envelope["truncated"] = True
        envelope["record"] = ""
        room = budget - len(json.dumps(envelope, separators=(",", ":")).encode())
        cut = max(0, room)
        while True:  # escaping can grow the prefix; shrink until it fits
            envelope["record"] = record_text[:cut]
            body = json.dumps(envelope, separators=(",", ":")).encode()
            if len(body) <= budget or cut == 0:
                break
            cut = max(0, cut - max(1, (len(body) - budget)))
    headers = {HDR_REASON: _header_text(letter.reason), HDR_STEP: step, HDR_ORIGIN: _header_text(origin)}
    if letter.msg_id:  # the body's digest too: a letter forged under the id cannot suppress the real one
        headers["Nats-Msg-Id"] = f"{letter.msg_id}:{payload_digest(body)}"
    return headers, body


async def publish_dead_letters(
    js: nats.js.JetStreamContext,
    pipeline: str,
    vertex: str,
    records: Sequence[dict | DeadLetter],
    reason: str = "",
    max_payload: int | None = None,
    subject: str | None = None,
) -> int:
    """Publish one dead letter per record (acked); a plain dict takes ``reason``.

    ``subject`` overrides ``naming.dlq_subject(pipeline, vertex)`` (it must
    still fall in the dead-letter stream's ``isb.<pipeline>.dlq.>``).

    ``js``: a JetStream context, or a store object with its own dead-letter role (Redis:
    :class:`isbflow.isb.redis.dead_letters.RedisDeadLetters`, one entry per letter, its body as
    here). Runs wherever there is a connection (driver or executor). Returns how many the store
    stored (duplicates of an earlier attempt not counted).
    Raises :class:`DeadLetterBufferNotFound` when no stream stores the
    subject, and the publish error when the stream is full: a record must
    never vanish silently.
    """
    own = getattr(js, "dead_letters", None)
    if own is not None and callable(own):  # a store object (Redis): the letters go through its role
        letters = [r if isinstance(r, DeadLetter) else DeadLetter(record=r, reason=reason) for r in records]
        encoded = []
        for letter in letters:
            headers, body = encode_dead_letter(letter, vertex, max_payload or MAX_LETTER_BYTES + HEADER_ROOM)
            encoded.append((headers.get("Nats-Msg-Id"), body))
        return await own().publish(naming.dlq_stream(pipeline), encoded)
    if max_payload is None:
        max_payload = js._nc.max_payload  # the server's limit, learnt on connect
    subject = subject or naming.dlq_subject(pipeline, vertex)
    stored = 0
    for r in records:  # one by one: dead letters are rare, and js.publish reports a refusal
        letter = r if isinstance(r, DeadLetter) else DeadLetter(record=r, reason=reason)
        headers, body = encode_dead_letter(letter, vertex, max_payload)
        try:
            ack = await js.publish(subject, body, headers=headers, timeout=_ACK_TIMEOUT)
        except NoStreamResponseError:
            raise DeadLetterBufferNotFound(pipeline, subject) from None
        stored += not ack.duplicate
    return stored


def dead_letter_target(nc: Any) -> Any:
    """Where :func:`publish_dead_letters` writes on connection ``nc``: a store object itself, or
    a nats-py client's JetStream context."""
    return nc if callable(getattr(nc, "dead_letters", None)) else nc.jetstream()


def publish_dead_letters_sync(
    settings: NatsSettings,
    pipeline: str,
    vertex: str,
    records: Sequence[dict | DeadLetter],
    reason: str = "",
) -> int:
    """:func:`publish_dead_letters` for code without an event loop (a plain executor function)."""

    return run_with(settings, lambda nc: publish_dead_letters(dead_letter_target(nc), pipeline, vertex, records, reason),
                    name=f"isbflow-dlq-{pipeline}-{vertex}")


async def read_dead_letters(settings: NatsSettings, pipeline: str, vertex: str | None = None,
                            limit: int = 100_000) -> list[dict]:
    """Dead letters of a pipeline (of one vertex when given), oldest first.

    Each is the letter's JSON body plus ``seq`` (its sequence in the
    dead-letter stream) and ``subject``. At most ``limit`` letters. For tests
    and the CLI: it reads message by message.
    """
    subject = naming.dlq_subject(pipeline, vertex) if vertex else f"isb.{pipeline}.dlq.>"
    stream = naming.dlq_stream(pipeline)
    async with session(settings, name=f"isbflow-dlq-read-{pipeline}") as nc:
        own = getattr(nc, "dead_letters", None)
        if own is not None and callable(own):
            return [{**letter, "seq": seq, "subject": naming.dlq_subject(pipeline, str(letter.get("step", "")))}
                    for seq, letter in await own().read(stream, vertex, limit)]
        jsm = nc.jsm()
        try:
            await jsm.stream_info(stream)
        except NotFoundError:
            return []
        out: list[dict] = []
        seq = 1
        while len(out) < limit:
            try:
                m = await jsm.get_msg(stream, seq=seq, subject=subject, next=True)
            except NotFoundError:
                break
            letter = json.loads(m.data or b"{}")
            letter["seq"], letter["subject"] = m.seq, m.subject
            out.append(letter)
            seq = m.seq + 1
        return out


async def dead_letter_origins(nc, pipeline: str) -> list[str]:
    """The ``_isb_id`` of every dead letter of a pipeline that has one (its ``Isb-Origin`` header),
    oldest first: what the offset ledger folds into a sink's ranges. Bounded by the dead-letter
    stream's own limits; ``[]`` when there is no dead-letter stream."""
    stream, subject = naming.dlq_stream(pipeline), f"isb.{pipeline}.dlq.>"
    own = getattr(nc, "dead_letters", None)
    if own is not None and callable(own):
        return [str(letter["origin"]) for _, letter in await own().read(stream) if letter.get("origin")]
    jsm = nc.jsm()
    out: list[str] = []
    seq = 1
    while True:
        try:
            m = await jsm.get_msg(stream, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return out
        origin = (m.headers or {}).get(HDR_ORIGIN)
        if origin:
            out.append(origin)
        seq = m.seq + 1


# ------------------------------------------------- frames dead-lettered on read


def dead_frames_key(vertex: str) -> str:
    """The status KV key counting the frames ``vertex`` dead-lettered on read."""
    return f"deadframes.{vertex}"


async def dead_frames(nc, pipeline: str, vertex: str) -> int:
    """How many frames ``vertex`` dead-lettered on read so far (0 when none, or no status bucket)."""
    try:
        kv = await open_kv(nc, naming.status_bucket(pipeline))
        raw = await kv.get(dead_frames_key(vertex))
    except BucketMissing:
        return 0
    try:
        return int(raw or 0)
    except ValueError:
        return 0


async def add_dead_frames(nc, pipeline: str, vertex: str, n: int) -> None:
    """Add ``n`` to :func:`dead_frames` (atomically: tasks of one step may add at once)."""
    kv = await open_kv(nc, naming.status_bucket(pipeline))
    try:
        await kv.add(dead_frames_key(vertex), n)
    except TimeoutError:
        raise BufferReadError(f"could not count {n} dead-lettered frame(s) of step {vertex}: the status key "
                              f"{dead_frames_key(vertex)} kept changing") from None
