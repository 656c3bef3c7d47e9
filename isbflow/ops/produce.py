"""The demo's producer: deterministic log events published to a JetStream source.

Contract:

- :func:`log_event` ``(seed, i)`` is pure: the same seed and index always give
  the same event, on any machine. :func:`events` lists what a run put in, so
  tests and benchmarks recompute expected results without reading anything back.
- Event ``i`` has event time ``BASE_TIME + i * EVENT_SPACING`` minus a jitter of
  at most ``MAX_JITTER`` (bounded out-of-order, well inside a 2-minute
  watermark); one service is hot (about 40% of events). ``shift_ms`` moves every
  event time by a fixed amount (:func:`shift_for`: the live demo's events carry
  the wall-clock time they are produced at, so freshness checks mean something).
- :func:`produce` publishes events ``start .. start+count-1`` to the source's
  subject with **acknowledged** publishes (core NATS publishes get dropped
  under load), pipelined in a window of unacknowledged messages.
  Every message carries ``Nats-Msg-Id = <seed>-<index>``: running the same range
  again within the stream's duplicates window stores nothing twice (the report
  counts those ``duplicates``).
- With ``malformed_every=K`` every K-th event (index ``i % K == K - 1``) is
  replaced by a malformed payload (invalid JSON, or a field of the wrong type),
  to exercise the dead-letter path; :func:`events` leaves those out.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any

from nats.js.errors import NoStreamResponseError, NotFoundError

from isbflow.isb import naming
from isbflow.isb.connect import NatsSettings, session
from isbflow.isb.publish import Ack, AckedPublisher
from isbflow.isb.store import OutFrame, has_buffer_role, write_until_stored
from isbflow.spec.models import Pipeline

BASE_TIME = datetime(2025, 1, 1, tzinfo=UTC)
EVENT_SPACING = timedelta(milliseconds=10)  # 100 events per second of event time
MAX_JITTER = timedelta(seconds=5)
_SPACING_MS = EVENT_SPACING // timedelta(milliseconds=1)
_JITTER_MS = MAX_JITTER // timedelta(milliseconds=1)

SERVICES = ("checkout", "api-gateway", "auth", "catalog", "payments", "search", "shipping", "users")
HOT_SERVICE = SERVICES[0]
_HOT_SHARE = 0.4
_BASE_LATENCY = {"checkout": 40.0, "api-gateway": 8.0, "auth": 15.0, "catalog": 25.0,
                 "payments": 120.0, "search": 60.0, "shipping": 35.0, "users": 12.0}
_PATHS = {"checkout": "/cart/checkout", "api-gateway": "/", "auth": "/login", "catalog": "/items",
          "payments": "/charge", "search": "/search", "shipping": "/quote", "users": "/profile"}
_METHODS = ("GET", "GET", "GET", "POST")
#: Publishes in flight (sent, not yet acknowledged).
DEFAULT_WINDOW = 20_000
_ACK_TIMEOUT = 30.0
_PROGRESS_EVERY = 1000  # acknowledgements per progress callback
_MASK = (1 << 64) - 1
_EIGHT_U16 = struct.Struct("<8H").unpack


class SourceNotProvisioned(Exception):
    """The source's stream does not exist (or does not take its subject): run ``isbflow isb apply``."""


class ProduceFailed(Exception):
    """The ISB service refused or did not acknowledge publishes; the message says which and why."""


@dataclass
class ProduceReport:
    pipeline: str
    vertex: str
    stream: str
    subject: str
    seed: int
    start: int
    count: int
    published: int  # stored by the server (acknowledged, not a duplicate)
    duplicates: int  # acknowledged as duplicates of an earlier run (same Nats-Msg-Id)
    malformed: int  # of count, how many were deliberately malformed
    seconds: float

    @property
    def rate(self) -> float:
        """Acknowledged messages per second."""
        return (self.published + self.duplicates) / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "rate": round(self.rate, 1)}


# ------------------------------------------------------------------ the events


def _mix(x: int) -> int:
    """splitmix64's finaliser: a fast, well-spread pure function of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _uniforms(seed: int, i: int) -> list[float]:
    """Eight independent-looking floats in [0, 1) (16 bits each) for event ``i`` of ``seed``."""
    h1 = _mix((seed * 0x100000001B3) ^ i)
    return [v / 65536.0 for v in _EIGHT_U16(h1.to_bytes(8, "little") + _mix(h1).to_bytes(8, "little"))]


def event_time(i: int, jitter_fraction: float = 0.0) -> datetime:
    """Event time of index ``i``, ``jitter_fraction`` of MAX_JITTER early (whole milliseconds)."""
    return BASE_TIME + timedelta(milliseconds=_event_ms(i, jitter_fraction))


def _event_ms(i: int, jitter_fraction: float) -> int:
    return i * _SPACING_MS - int(jitter_fraction * _JITTER_MS)


@lru_cache(maxsize=4096)
def _second_prefix(second: int) -> str:
    return (BASE_TIME + timedelta(seconds=second)).strftime("%Y-%m-%dT%H:%M:%S.")


def format_ts(t: datetime) -> str:
    """ISO-8601 with milliseconds in UTC, e.g. ``2025-01-01T00:00:01.230Z``."""
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def _format_ms(ms: int) -> str:
    """``format_ts(BASE_TIME + ms)``, fast for the generator."""
    second, rest = divmod(ms, 1000)
    return f"{_second_prefix(second)}{rest:03d}Z"


def shift_for(event_time_from: datetime, start: int) -> int:
    """The ``shift_ms`` that gives event ``start`` the time ``event_time_from`` (before its jitter)."""
    t = event_time_from if event_time_from.tzinfo else event_time_from.replace(tzinfo=UTC)
    return int((t - BASE_TIME) / timedelta(milliseconds=1)) - start * _SPACING_MS


def log_event(seed: int, i: int, shift_ms: int = 0) -> dict[str, Any]:
    """Event ``i`` of run ``seed``: fields of the demo source's schema (pipelines/logs.yaml);
    its event time moved by ``shift_ms`` milliseconds."""
    u_svc, u_lvl, u_status, u_lat, u_tail, u_host, u_jit, u_meth = _uniforms(seed, i)
    if u_svc < _HOT_SHARE:
        service = HOT_SERVICE
    else:
        service = SERVICES[1 + int((u_svc - _HOT_SHARE) / (1 - _HOT_SHARE) * (len(SERVICES) - 1))]
    if u_lvl < 0.03:
        level = "ERROR"
        status = 500 if u_status < 0.7 else 503
    elif u_lvl < 0.10:
        level = "WARN"
        status = 404 if u_status < 0.6 else 400 if u_status < 0.9 else 429
    elif u_lvl < 0.20:
        level = "DEBUG"
        status = 200
    else:
        level = "INFO"
        status = 200 if u_status < 0.85 else 201 if u_status < 0.95 else 304
    latency = _BASE_LATENCY[service] * (0.5 + u_lat)
    if u_tail < 0.05:  # a slow tail, so p95 differs from the mean
        latency *= 4 + 8 * u_lat
    if level == "ERROR":
        latency *= 3
    method = _METHODS[int(u_meth * len(_METHODS))]
    return {
        "ts": _format_ms(_event_ms(i, u_jit) + shift_ms),
        "service": service,
        "level": level,
        "host": f"{service}-{int(u_host * 4)}",
        "latency_ms": round(latency, 1),
        "status": status,
        "msg": f"{method} {_PATHS[service]} {status}",
    }


def is_malformed(i: int, malformed_every: int | None) -> bool:
    return bool(malformed_every) and i % malformed_every == malformed_every - 1


def malformed_payload(seed: int, i: int) -> bytes:
    """A payload the source step cannot parse: invalid JSON, or a field of the wrong type."""
    if i % 2 == 0:
        return json.dumps(log_event(seed, i), separators=(",", ":")).encode()[:-7]  # cut mid-object
    bad = dict(log_event(seed, i), latency_ms="fast", status="ok")
    return json.dumps(bad, separators=(",", ":")).encode()


def payload(seed: int, i: int, malformed_every: int | None = None, shift_ms: int = 0) -> bytes:
    """The message body of event ``i`` as published."""
    if is_malformed(i, malformed_every):
        return malformed_payload(seed, i)
    e = log_event(seed, i, shift_ms)
    # the generator's strings need no escaping: format directly (json.dumps is 2x slower)
    return (f'{{"ts":"{e["ts"]}","service":"{e["service"]}","level":"{e["level"]}",'
            f'"host":"{e["host"]}","latency_ms":{e["latency_ms"]!r},"status":{e["status"]},'
            f'"msg":"{e["msg"]}"}}').encode()


def msg_id(seed: int, i: int) -> str:
    return f"{seed}-{i}"


def events(seed: int = 0, start: int = 0, count: int = 0, malformed_every: int | None = None) -> list[dict]:
    """The well-formed events a run with these arguments publishes, in index order."""
    return [log_event(seed, i) for i in range(start, start + count) if not is_malformed(i, malformed_every)]


# ------------------------------------------------------------------ publishing


def source_vertex(pipeline: Pipeline, vertex: str | None = None) -> str:
    """The JetStream source vertex to publish to: ``vertex``, or the pipeline's only one."""
    candidates = [v.name for v in pipeline.spec.vertices if v.source is not None and v.source.jetstream]
    if vertex is not None:
        if vertex not in candidates:
            raise ValueError(f"pipeline {pipeline.name}: {vertex!r} is not a JetStream source vertex "
                             f"(JetStream sources: {', '.join(candidates) or 'none'})")
        return vertex
    if len(candidates) != 1:
        raise ValueError(f"pipeline {pipeline.name} has {len(candidates)} JetStream source vertices "
                         f"({', '.join(candidates) or 'none'}): name one with --vertex")
    return candidates[0]


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up; :meth:`take` waits for tokens."""

    def __init__(self, rate: float, burst: float | None = None):
        if rate <= 0:
            raise ValueError("rate must be > 0 records/s")
        self.rate = rate
        self.burst = burst if burst is not None else max(1.0, rate / 10)
        self.tokens = self.burst
        self.last = time.monotonic()

    async def take(self, n: int) -> None:
        while True:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            if self.tokens >= n or (n > self.burst and self.tokens >= self.burst):
                self.tokens -= n
                return
            await asyncio.sleep((min(n, self.burst) - self.tokens) / self.rate)


class _AckCounter:
    """Acknowledgements of one run, counted in one inbox callback (no future per message).

    The publisher's key of each message is its index; an index counts once,
    so a retried message acknowledged twice is not counted twice.
    """

    def __init__(self, start: int, count: int, progress: Callable[[int], None] | None):
        self.start = start
        self.acked = bytearray(count)
        self.done = self.duplicates = self.in_flight = self.unreported = 0
        self.errors: list[str] = []
        #: messages still answered 503 (no stream responded) after the publisher sent them again
        #: for _ACK_TIMEOUT (in a cluster, a stream electing a new leader answers 503 for seconds)
        self.unavailable = 0
        self.progress = progress
        self.every = _PROGRESS_EVERY
        self.room = asyncio.Event()
        self.low = 0

    def on_ack(self, i: int, ack: Ack | None, error: BaseException | None) -> None:
        """The publisher's :data:`~isbflow.isb.publish.OnAck` for message ``i``."""
        self.in_flight -= 1
        if self.in_flight <= self.low:
            self.room.set()
        if error is not None:
            if isinstance(error, NoStreamResponseError):  # still 503 after the publisher's resends
                self.unavailable += 1
            else:
                self.errors.append(str(error))
            return
        k = i - self.start
        if self.acked[k]:
            return
        self.acked[k] = 1
        self.done += 1
        if ack.duplicate:
            self.duplicates += 1
        self.unreported += 1
        if self.unreported >= self.every:
            self.report_progress()

    def report_progress(self) -> None:
        if self.progress is not None and self.unreported:
            self.progress(self.unreported)
        self.unreported = 0

    def missing(self) -> list[int]:
        return [self.start + k for k, a in enumerate(self.acked) if not a]


async def produce(
    settings: NatsSettings,
    pipeline: Pipeline,
    vertex: str | None = None,
    *,
    count: int,
    rate: float | None = None,
    seed: int = 0,
    start: int = 0,
    malformed_every: int | None = None,
    window: int = DEFAULT_WINDOW,
    progress: Callable[[int], None] | None = None,
    shift_ms: int = 0,
) -> ProduceReport:
    """Publish events ``start .. start+count-1`` of ``seed`` to the source vertex's subject.

    Keeps up to ``window`` publishes unacknowledged and waits for every
    acknowledgement; a message whose acknowledgement does not come within
    ``_ACK_TIMEOUT`` is published again with its same id (stored once).
    ``rate`` caps records per second; ``progress(n)`` is called with the number
    newly acknowledged; ``shift_ms`` moves every event time (:func:`shift_for`). Raises :class:`SourceNotProvisioned` when the source
    stream is missing, :class:`ProduceFailed` when the server refuses messages
    or never acknowledges them.
    """
    if count < 0 or start < 0:
        raise ValueError("count and start must be >= 0")
    if malformed_every is not None and malformed_every < 1:
        raise ValueError("malformed_every must be >= 1")
    name = source_vertex(pipeline, vertex)
    jet = pipeline.vertex(name).source.jetstream  # type: ignore[union-attr]
    subject, stream = jet.subject, naming.source_stream(pipeline, name)
    window = max(1, window)
    bucket = TokenBucket(rate, burst=max(1.0, min(rate / 10, window))) if rate else None
    step = 1 if bucket is None else max(1, int(bucket.burst))

    async with session(settings, name="isbflow-produce") as nc:
        if has_buffer_role(nc):  # a store with a writer role (Redis)
            return await _produce_to_store(nc, settings, pipeline, name, stream, subject, seed=seed, start=start,
                                           count=count, malformed_every=malformed_every, shift_ms=shift_ms,
                                           bucket=bucket, progress=progress)
        js = nc.jetstream()
        try:
            info = await js.stream_info(stream)
        except NotFoundError:
            raise SourceNotProvisioned(
                f"the source stream {stream} of {pipeline.name}/{name} does not exist on "
                f"{settings.display}: create it with 'isbflow isb apply -f <spec>'") from None
        if subject not in (info.config.subjects or []):
            raise SourceNotProvisioned(
                f"the stream {stream} does not take subject {subject!r} (it takes "
                f"{info.config.subjects}): update it with 'isbflow isb apply -f <spec>'")

        acks = _AckCounter(start, count, progress)
        acks.low = window // 2
        if rate:
            acks.every = max(1, min(_PROGRESS_EVERY, int(rate / 10)))
        def message_of(i: int) -> tuple[str, bytes, dict[str, str]]:
            return subject, payload(seed, i, malformed_every, shift_ms), {"Nats-Msg-Id": msg_id(seed, i)}

        pub = AckedPublisher(nc, acks.on_ack, message_of, unavailable_for=_ACK_TIMEOUT)
        await pub.start()

        def refused() -> ProduceFailed:
            return ProduceFailed(f"the ISB service at {settings.display} refused messages for {subject} "
                                 f"(stream {stream}): {acks.errors[0]} ({len(acks.errors)} refused)")

        async def send(indexes: Iterator[int] | range) -> None:
            n = 0
            for i in indexes:
                if bucket is not None and n % step == 0:
                    await bucket.take(step)
                n += 1
                await pub.publish(subject, payload(seed, i, malformed_every, shift_ms),
                                  {"Nats-Msg-Id": msg_id(seed, i)}, i)
                acks.in_flight += 1
                if acks.in_flight >= window:
                    acks.room.clear()
                    try:
                        await asyncio.wait_for(acks.room.wait(), _ACK_TIMEOUT)
                    except TimeoutError:
                        acks.in_flight = 0  # the missing ones are sent again below
                if acks.errors:
                    raise refused()

        t0 = time.perf_counter()
        await send(range(start, start + count))
        resends = 0
        while True:  # wait for the last acks; resend what never got one (3 times at most)
            last, idle_since = acks.done, time.monotonic()
            while acks.done < count and not acks.errors:
                await asyncio.sleep(0.005)
                if acks.done != last:
                    last, idle_since = acks.done, time.monotonic()
                elif time.monotonic() - idle_since > _ACK_TIMEOUT or not pub.in_flight:
                    break  # acks lost, or every answer is in (some 503 after the publisher's resends)
            if acks.errors:
                raise refused()
            if acks.done == count or acks.unavailable:
                break
            resends += 1
            if resends > 3:
                break
            pub.forget()
            acks.in_flight = 0
            await send(iter(acks.missing()))
        if acks.done < count:
            why = f" ({acks.unavailable} answered 'no stream took the message')" if acks.unavailable else ""
            raise ProduceFailed(f"{count - acks.done} of {count} messages to {subject} (stream {stream}) were "
                                f"never acknowledged by {settings.display}{why}; re-run the same command: "
                                "ids make it safe")
        seconds = time.perf_counter() - t0
        acks.report_progress()
        await pub.close()
    malformed = sum(1 for i in range(start, start + count) if is_malformed(i, malformed_every))
    return ProduceReport(pipeline.name, name, stream, subject, seed, start, count,
                         acks.done - acks.duplicates, acks.duplicates, malformed, seconds)


#: events per write call on a store with a writer role
STORE_WRITE_EVENTS = 500


async def _produce_to_store(store: Any, settings: Any, pipeline: Pipeline, name: str, stream: str, subject: str, *,
                            seed: int, start: int, count: int, malformed_every: int | None, shift_ms: int,
                            bucket: TokenBucket | None, progress: Callable[[int], None] | None) -> ProduceReport:
    """:func:`produce` on a store with a writer role (Redis): each event one entry under its id
    ``<seed>-<index>`` (stored once however often it is written), in calls of :data:`STORE_WRITE_EVENTS`,
    or under a ``bucket`` of its burst at most (the rate's tokens taken a call at a time: a call of
    more than the burst would go out unthrottled); a full source waits (back-pressure) until the
    source step has committed and released."""
    writer = store.buffer(stream, create_missing=False)  # a lost source stream is refused, never made again
    chunk = STORE_WRITE_EVENTS if bucket is None else max(1, min(STORE_WRITE_EVENTS, int(bucket.burst)))
    if not await writer.created():  # the producer's user may not read the stream's state, only ask this
        raise SourceNotProvisioned(
            f"the source stream {stream} of {pipeline.name}/{name} does not exist on {settings.display}: "
            "create it with 'isbflow isb apply -f <spec>'")
    published = duplicates = 0
    t0 = time.perf_counter()
    for lo in range(start, start + count, chunk):
        hi = min(lo + chunk, start + count)
        if bucket is not None:
            await bucket.take(hi - lo)
        written = await write_until_stored(writer, [OutFrame(msg_id(seed, i), payload(seed, i, malformed_every, shift_ms), 1)
                                                    for i in range(lo, hi)])
        dup = sum(w.duplicate for w in written)
        published, duplicates = published + len(written) - dup, duplicates + dup
        if progress is not None:
            progress(len(written))
    malformed = sum(1 for i in range(start, start + count) if is_malformed(i, malformed_every))
    return ProduceReport(pipeline.name, name, stream, subject, seed, start, count, published, duplicates, malformed,
                         time.perf_counter() - t0)


def iter_payloads(seed: int, start: int, count: int,
                  malformed_every: int | None = None) -> Iterator[tuple[str, bytes]]:
    """``(Nats-Msg-Id, body)`` of each message a run publishes, in order."""
    for i in range(start, start + count):
        yield msg_id(seed, i), payload(seed, i, malformed_every)
