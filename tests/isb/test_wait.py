"""Waiting for a buffer to grow (isbflow.isb.wait) on a real nats-server: woken by an append (its
headers, republished by the stream), also by one made before the wait began, not by nothing; told to
stop; makes no consumer; a stream that republishes nothing is looked at each trigger instead."""

from __future__ import annotations

import asyncio

from nats.js.api import RePublish, StreamConfig

from isbflow.isb import naming
from isbflow.isb.connect import session
from isbflow.isb.wait import wait_for_append

STREAMS = {"wt-a": "wt.a", "wt-b": "wt.b"}


async def _setup(nc) -> None:
    js = nc.jetstream()
    for stream, subject in STREAMS.items():
        await js.add_stream(StreamConfig(name=stream, subjects=[subject], republish=RePublish(
            src=">", dest=naming.wake_subject(stream), headers_only=True)))
        await js.publish(subject, b"first")
    await js.add_stream(StreamConfig(name="wt-plain", subjects=["wt.plain"]))  # no RePublish


async def _consumers(nc) -> int:
    n = 0
    for s in STREAMS:
        n += (await nc.jetstream().stream_info(s)).state.consumer_count
    return n


def test_an_append_wakes_the_wait_and_nothing_is_left_behind(nats_server):
    async def go():
        async with session(nats_server.settings, name="t-wait") as nc:
            await _setup(nc)
            seen = dict.fromkeys(STREAMS, 1)

            async def later():
                await asyncio.sleep(0.5)
                await nc.jetstream().publish("wt.b", b"second")

            task = asyncio.create_task(later())
            woke = await wait_for_append(nc, seen, timeout=60)
            await task
            # appended before the wait began (between a look and the wait): it wakes at once
            early = await wait_for_append(nc, {"wt-a": 1, "wt-b": 1}, timeout=60)
            # nothing past what was seen: the wait ends at its timeout
            idle = await wait_for_append(nc, {"wt-a": 1, "wt-b": 2}, timeout=1.0)
            # told to stop waiting
            told = await wait_for_append(nc, {"wt-a": 1, "wt-b": 2}, timeout=60, cancelled=lambda: True)
            # a stream that does not exist: the caller looks again at once
            missing = await wait_for_append(nc, {"wt-none": 0}, timeout=60)
            # a stream that republishes nothing cannot be waited on: look again at once
            plain = await wait_for_append(nc, {"wt-plain": 0}, timeout=60)
            # the waits read headers only: the messages are still in their streams, nothing consumed
            info = await nc.jetstream().stream_info("wt-b")
            return woke, early, idle, told, missing and plain, await _consumers(nc), info.state.messages

    woke, early, idle, told, missing, consumers, kept = asyncio.run(go())
    assert (woke, early, idle, told, missing) == (True, True, False, False, True)
    assert consumers == 0 and kept == 2
