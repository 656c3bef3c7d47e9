"""The one acknowledged JetStream publisher, shared by the step's writer and the producer.

Many publishes in flight on one connection: each carries a reply subject
``<inbox>.<token>`` and one wildcard subscription takes every PubAck, so a
publish costs one ``nc.publish`` and no round trip. Each publish gets a future
that completes with an :class:`Ack` (was it a duplicate), or fails with the
stream's typed error (``APIError``: e.g. "maximum messages exceeded").

nats-py's ``publish_async`` cannot serve here: its reply handler raises a
stream's error reply instead of failing the future, so a refused publish
never completes.

A ``503`` reply means no stream answered: in a cluster, while a stream
elects a new leader, or when the stream does not exist. The publisher sends
such a message again (same ``Nats-Msg-Id``, so stored once) with a growing
pause, for up to ``unavailable_for`` seconds after its first 503, and only
then fails its future with ``NoStreamResponseError``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from nats.js.errors import APIError, NoStreamResponseError

#: seconds a caller waits for one acknowledgement before it calls the publish lost
ACK_TIMEOUT = 30.0
#: first and largest pause before a message answered with 503 is sent again
_RESEND_FIRST, _RESEND_MAX = 0.1, 2.0


class Ack(NamedTuple):
    """What a caller learns from a PubAck: whether the stream already held the message id."""

    duplicate: bool


_FIRST, _AGAIN = Ack(False), Ack(True)

#: ``on_ack(key, ack, error)``: exactly one of ``ack`` and ``error`` is set
OnAck = Callable[[Any, "Ack | None", "BaseException | None"], None]
#: ``message_of(key)``: ``(subject, payload, headers)`` of a publish to send again
MessageOf = Callable[[Any], "tuple[str, bytes, dict[str, str]]"]


async def settled(fut: asyncio.Future, timeout: float = ACK_TIMEOUT) -> Ack:
    """The future's ack, waiting at most ``timeout`` (no timer when it is already in)."""
    if fut.done():
        return fut.result()
    return await asyncio.wait_for(asyncio.shield(fut), timeout)


def resolve_future(fut: asyncio.Future, ack: Ack | None, error: BaseException | None) -> None:
    """An :data:`OnAck` for callers that want a future per publish (pass the future as the key)."""
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(ack)


class AckedPublisher:
    """Acked publishes with many in flight (module docstring states the protocol).

    ``start()`` once on the running loop, then ``await publish(subject, payload,
    headers, key)``; each publish's outcome reaches ``on_ack(key, ack, error)``
    once, in the connection's callback (no future or task per message: the
    producer publishes tens of thousands per second). A caller that wants
    futures passes :func:`resolve_future` and a future as the key.
    ``forget()`` drops every publish still waiting (a caller that gives up on
    lost acknowledgements and sends again). The publisher keeps only each
    publish's key, never its payload: ``message_of(key)`` gives the message
    back when a 503 asks for it again (tens of thousands of payloads held
    here would cost the garbage collector more than the publishing itself).
    """

    def __init__(self, nc: Any, on_ack: OnAck, message_of: MessageOf, *,
                 unavailable_for: float = ACK_TIMEOUT):
        self.nc = nc
        self.on_ack = on_ack
        self.message_of = message_of
        self.unavailable_for = unavailable_for
        #: token -> the caller's key
        self.pending: dict[str, Any] = {}
        #: token -> [first 503 time, next pause], for publishes answered 503
        self._retrying: dict[str, list[float]] = {}
        #: 503 answers seen (each is followed by a resend until ``unavailable_for`` passes)
        self.unavailable = 0
        self._count = 0
        self._prefix = ""
        self._sub = None

    async def start(self) -> None:
        self._prefix = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(f"{self._prefix}.*", cb=self._on_reply,
                                            pending_msgs_limit=0, pending_bytes_limit=0)

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str], key: Any) -> None:
        self._count += 1
        token = str(self._count)
        self.pending[token] = key
        await self.nc.publish(subject, payload, reply=f"{self._prefix}.{token}", headers=headers)

    def forget(self) -> list[Any]:
        """Stop waiting for every publish still unanswered; their keys, oldest first."""
        keys = list(self.pending.values())
        self.pending.clear()
        self._retrying.clear()
        return keys

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    async def _on_reply(self, msg: Any) -> None:
        token = msg.subject[msg.subject.rfind(".") + 1:]
        key = self.pending.pop(token, None)
        if key is None:
            return
        data = msg.data
        if not data and msg.headers and msg.headers.get("Status") == "503":
            self._unavailable(token, key)
            return
        if self._retrying:
            self._retrying.pop(token, None)
        if data.find(b'"error"') < 0 and data.find(b'"duplicate"') < 0:  # the common ack: no parse
            self.on_ack(key, _FIRST, None)
            return
        try:
            resp = json.loads(data)
            if "error" in resp:
                APIError.from_error(resp["error"])  # raises the typed error
        except Exception as e:  # noqa: BLE001 - handed to the caller
            self.on_ack(key, None, e)
            return
        self.on_ack(key, _AGAIN if resp.get("duplicate") else _FIRST, None)

    def _unavailable(self, token: str, key: Any) -> None:
        self.unavailable += 1
        now = time.monotonic()
        retry = self._retrying.setdefault(token, [now, _RESEND_FIRST])
        if now - retry[0] >= self.unavailable_for:
            del self._retrying[token]
            self.on_ack(key, None, NoStreamResponseError())
            return
        self.pending[token] = key
        asyncio.get_running_loop().call_later(retry[1], self._resend, token)
        retry[1] = min(retry[1] * 2, _RESEND_MAX)

    def _resend(self, token: str) -> None:
        if token in self.pending:
            asyncio.ensure_future(self._send_again(token))

    async def _send_again(self, token: str) -> None:
        key = self.pending.get(token)
        if key is None:
            return
        try:
            subject, payload, headers = self.message_of(key)
            await self.nc.publish(subject, payload, reply=f"{self._prefix}.{token}", headers=headers)
        except Exception as e:  # noqa: BLE001 - the connection is gone: the caller learns it here
            if self.pending.pop(token, None) is not None:
                self._retrying.pop(token, None)
                self.on_ack(key, None, e)
