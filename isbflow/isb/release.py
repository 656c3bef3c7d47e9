"""Releasing buffer space after the downstream commit.

Contract of :func:`release`: called by the runner only AFTER the downstream
commit that covers ``upto_seq`` (the sink's Delta commit, or the next step's
batch commit), never by the reader (Spark's reader ``commit`` is a batch late
and skipped for the last availableNow batch). Idempotent, and it
never removes a sequence above ``upto_seq``:

- ``WorkQueue`` / ``Interest`` retention: purges every message with sequence
  ``<= upto_seq`` (JetStream's purge request ``{"seq": n}`` removes everything
  *below* ``n``, so it is sent ``n = upto_seq + 1``);
- ``Limits`` retention: does nothing; the data stays until ``maxMsgs`` /
  ``maxAge`` / ``maxBytes`` let it go (and the reader reports buffer loss if
  that happens before it was read).

Interest retention needs a consumer: JetStream removes a message of an
``Interest`` stream as soon as no consumer is interested in it, so with no
consumer at all every message is dropped the moment it is stored (checked on
nats-server 2.15.1: 5 published, 0 kept). Provisioning must therefore create,
per edge-partition stream, one durable consumer standing for the downstream
reader, :func:`interest_hold_consumer`: a pull consumer that nobody pulls from,
so it never acknowledges anything and every message stays until
:func:`release` purges it. (The reader itself never uses a consumer; it reads
with direct gets, see :mod:`isbflow.isb.read`.)
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, ReplayPolicy

from isbflow.isb.connect import NatsSettings, connect
from isbflow.isb.errors import BufferReadError
from isbflow.isb.read import API, stream_state

if TYPE_CHECKING:
    import nats.aio.client

log = logging.getLogger(__name__)

#: Durable name of the consumer that holds an Interest stream's messages for its reader.
HOLD_CONSUMER = "isbflow-hold"


def interest_hold_consumer(name: str = HOLD_CONSUMER) -> ConsumerConfig:
    """The consumer provisioning creates on every ``Interest`` edge stream (see module doc).

    Durable (survives restarts, no ``inactive_threshold``), pull (no
    ``deliver_subject``: nothing is pushed, so nothing is ever delivered or
    acknowledged), explicit acks, from the first message, no subject filter
    (interest in the whole stream). Create it with the stream, before the first
    publish: messages stored while no consumer exists are dropped at once.
    """
    return ConsumerConfig(
        durable_name=name,
        name=name,
        description="isbflow: holds messages until the downstream commit releases them",
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        replay_policy=ReplayPolicy.INSTANT,
    )


def _retention_kind(retention: object) -> str:
    """``Limits`` / ``Interest`` / ``WorkQueue`` from the spec, or JetStream's lower-case names."""
    text = str(getattr(retention, "value", retention)).lower().replace("_", "")
    if text not in ("limits", "interest", "workqueue"):
        raise ValueError(f"unknown retention {retention!r} (expected Limits, Interest or WorkQueue)")
    return text


async def release(
    settings: NatsSettings | None,
    stream: str,
    upto_seq: int,
    retention: object,
    *,
    incarnation: str | None = None,
    nc: nats.aio.client.Client | None = None,
) -> int:
    """Free ``stream``'s messages up to ``upto_seq`` once downstream committed them; returns how many.

    ``retention``: the stream's retention (spec ``Retention`` or its string).
    ``incarnation``: the incarnation ``upto_seq`` belongs to; when the stream has
    since been recreated nothing is purged (its sequences are other records).
    ``nc``: an open client to reuse instead of connecting with ``settings``.
    """
    kind = _retention_kind(retention)
    if kind == "limits" or upto_seq < 1:
        return 0
    own = nc is None
    if own:
        if settings is None:
            raise ValueError("release() needs settings or an open client")
        nc = await connect(settings, name="isbflow-release")
    try:
        if incarnation is not None:
            st = await stream_state(nc, stream)
            if st is None or st.incarnation != incarnation:
                log.warning("release of %s up to %d skipped: the stream was recreated or deleted",
                            stream, upto_seq)
                return 0
        msg = await nc.request(f"{API}.STREAM.PURGE.{stream}",
                               json.dumps({"seq": upto_seq + 1}).encode(), timeout=10)
        resp = json.loads(msg.data)
        if resp.get("error"):
            raise BufferReadError(f"buffer {stream}: purge up to {upto_seq} failed: "
                                  f"{resp['error'].get('description', resp['error'])}")
        return int(resp.get("purged", 0))
    finally:
        if own:
            await nc.close()
