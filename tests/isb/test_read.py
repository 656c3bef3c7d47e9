"""Range reads (isbflow.isb.read) of large events against a real nats-server: every event once,
and the bytes one read holds bounded (issue 19: 1 MiB events made a worker hold tens of GiB)."""

from __future__ import annotations

import asyncio
import tracemalloc

import pytest
from nats.js.api import StreamConfig

from isbflow.isb import raw, read
from isbflow.isb.connect import connect

EVENTS = 200
EVENT_BYTES = 1 << 20
MIB = 1 << 20


async def _publish(nc) -> None:
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="big", subjects=["big"], allow_direct=True))
    for i in range(EVENTS):
        await js.publish("big", bytes([i % 251]) * EVENT_BYTES)


@pytest.mark.parametrize("path", ["consume_range", "read_range"])
def test_one_mib_events_are_read_once_within_the_byte_bound(nats_server, path):
    """200 events of 1 MiB (200 MiB) in one range: each lists at most a request's bytes, and the
    Python heap of the reading process peaks near ``read_bound``, not at the range's size."""
    chunk_bytes = 4 * MIB

    async def go():
        nc = await connect(nats_server.settings)
        try:
            await _publish(nc)
            bound = read.read_bound(nc, max(chunk_bytes, nc.max_payload + 4096)
                                    if path == "consume_range" else chunk_bytes)
            seqs, largest = [], 0
            tracemalloc.start()
            try:
                async for msgs in getattr(read, path)(nc, "big", 1, EVENTS, chunk_bytes=chunk_bytes):
                    largest = max(largest, sum(len(m[1]) for m in msgs))
                    for seq, data, _, _ in msgs:
                        assert len(data) == EVENT_BYTES and data[:1] == bytes([(seq - 1) % 251])
                        seqs.append(seq)
                    del msgs
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            return seqs, largest, peak, bound, nc.max_payload
        finally:
            await nc.close()

    seqs, largest, peak, bound, max_payload = asyncio.run(go())
    assert seqs == list(range(1, EVENTS + 1))  # every event, once, in order
    per_request = max(chunk_bytes, max_payload + 4096) if path == "consume_range" else chunk_bytes
    assert largest <= per_request + EVENT_BYTES, f"a list of {largest} bytes"
    assert bound < EVENTS * EVENT_BYTES / 4
    assert peak <= bound, f"peak {peak / MIB:.1f} MiB held, bound {bound / MIB:.1f} MiB"


def test_the_raw_delivery_path_parses_any_split_of_the_wire_like_nats_py():
    """raw.deliver_raw's fast parser in front of nats-py's: hooked messages (with headers or
    without, with a reply subject or without) split at every byte of the wire arrive whole and in
    order, and another subscription's message is left to nats-py's parser (which then hands the
    hooked ones after it to the same handler). Fast: a client that never connects."""
    import nats.aio.client

    wire = (b"MSG in.1 5 $JS.ACK.s.c.1.7.7.1700000000000000000.3 3\r\nabc\r\n"
            b"MSG in.2 5 2\r\nde\r\n"
            b"MSG other 9 1\r\nz\r\n"
            b"HMSG in.3 5 r.x 24 26\r\nNATS/1.0\r\nK: v\r\nX: y\r\n\r\nhi\r\n"
            b"MSG in.4 5 r.y 0\r\n\r\n"
            b"HMSG in.5 5 16 19\r\nNATS/1.0 204\r\n\r\nend\r\n")
    want = [(b"in.1", b"$JS.ACK.s.c.1.7.7.1700000000000000000.3", b"abc", None),
            (b"in.2", b"", b"de", None),
            (b"in.3", b"r.x", b"hi", b"NATS/1.0\r\nK: v\r\nX: y\r\n\r\n"),
            (b"in.4", b"r.y", b"", None),
            (b"in.5", b"", b"end", b"NATS/1.0 204\r\n\r\n")]

    class Sub:
        _id = 5

    async def feed(parts: list[bytes]) -> tuple[list, int]:
        nc = nats.aio.client.Client()
        got: list = []
        raw.deliver_raw(nc, Sub, lambda *m: got.append(m))
        for part in parts:
            await nc._ps.parse(part)
        return got, nc.stats["in_msgs"]

    for cut in range(len(wire) + 1):
        got, counted = asyncio.run(feed([wire[:cut], wire[cut:]]))
        assert got == want, f"split at byte {cut}"
        assert counted == 6, f"split at byte {cut}"  # nats-py's count of every message received
    got, _ = asyncio.run(feed([wire[i:i + 1] for i in range(len(wire))]))
    assert got == want
    assert raw.parse_headers(want[2][3]) == {"K": "v", "X": "y"}
    assert raw.status_line(b"NATS/1.0 409 Message Size Exceeds MaxBytes\r\n\r\n") == \
        "409 Message Size Exceeds MaxBytes"
