"""Reading many small messages fast with nats-py: deliveries as bytes, straight off its parser.

nats-py's path for a subscription callback builds a ``Msg`` for every message (subject and
reply decoded, headers parsed into a dict), queues it and switches to the subscription's
task. For one-event messages that was most of a read task (py-spy on Spark's Python workers,
issue 14). :func:`deliver_raw` hands a subscription's deliveries to a plain function as the
parser reads them, with a fast path in front of nats-py's parser for runs of ``MSG`` and
``HMSG`` lines; :func:`no_cyclic_gc` keeps the cyclic collector off while a read fills a
chunk. :func:`isbflow.isb.read.consume_range` uses them.

nats-py keeps the connection: auth, TLS, reconnects, PING/PONG and every other
subscription. This reaches into three of its private names (``Client._process_msg``,
``Client._ps``, ``Subscription._id``); ``uv.lock`` pins the version, and
``tests/isb/test_read.py`` feeds the parser every split of a wire sample.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from nats.protocol.parser import AWAITING_CONTROL_LINE

if TYPE_CHECKING:
    import nats.aio.client


def deliver_raw(nc: nats.aio.client.Client, sub, handler: Callable[[bytes, bytes, bytes, bytes | None], None] | None) -> None:
    """Hand the deliveries of ``sub`` to ``handler(subject, reply, data, headers)`` as nats-py's
    parser reads them (bytes as on the wire; ``headers`` the raw header block or ``None``);
    ``None`` stops it.

    nats-py's own path for a subscription callback builds a ``Msg`` (subject and reply decoded,
    headers parsed into a dict), queues it and switches to the subscription's task for every
    message: over 40% of reading 140-byte events in one process (py-spy). A handler here is
    plain code on the parser's stack: it must not block, and it holds what it keeps (the range
    reads bound that by what their requests ask for: :mod:`isbflow.isb.read`, *Bounds*).
    """
    hooks = nc.__dict__.get("_isbflow_raw")
    if hooks is None:
        hooks = nc._isbflow_raw = {}
        process = nc._process_msg

        async def process_msg(sid, subject, reply, data, headers):
            h = hooks.get(sid)
            if h is None:
                return await process(sid, subject, reply, data, headers)
            stats = nc.stats  # kept true: nats-py counts what it receives here
            stats["in_msgs"] += 1
            stats["in_bytes"] += len(data)
            h(subject, reply, data, headers)

        nc._process_msg = process_msg
        _parse_raw_first(nc, hooks)
    if handler is None:
        hooks.pop(sub._id, None)
    else:
        hooks[sub._id] = handler


def _parse_raw_first(nc: nats.aio.client.Client, hooks: dict) -> None:
    """Put a fast path in front of nats-py's parser on ``nc``: a run of ``MSG`` and ``HMSG``
    lines for subscriptions in ``hooks`` is split with ``bytes.find`` and handed to their
    handlers (the header block raw); a hooked message not yet whole waits in the buffer for
    the next read; anything else (other subscriptions, PING, INFO) is left to nats-py's
    parser, which reaches the same handlers through ``_process_msg``.
    Measured on 200K events of ~140 B in one process holding what a Spark worker imports
    (four interleaved rounds, medians): 202K msg/s with nats-py's parser alone, 271K with
    this path."""
    ps = nc._ps
    parse = ps.parse
    stats = nc.stats

    async def parse_fast(data: bytes = b"") -> None:
        buf = ps.buf
        buf.extend(data)
        partial = False
        if ps.state == AWAITING_CONTROL_LINE and hooks:
            pos, end_all = 0, len(buf)
            view = memoryview(buf)  # slices of it copy once; released before buf is resized
            try:
                while True:
                    if buf.startswith(b"MSG ", pos):
                        op = 4
                    elif buf.startswith(b"HMSG ", pos):
                        op = 5
                    else:
                        break
                    eol = buf.find(b"\r\n", pos)
                    if eol < 0:
                        partial = True
                        break
                    args = bytes(view[pos + op:eol]).split()
                    hsize = b"0"
                    if len(args) == op:  # MSG subject sid reply size, HMSG subject sid reply hsize size
                        subject, sid, reply, *sizes = args
                    elif len(args) == op - 1:
                        (subject, sid, *sizes), reply = args, b""
                    else:
                        break
                    h = hooks.get(int(sid))
                    if h is None:
                        break
                    if op == 5:
                        hsize, size = sizes
                    else:
                        (size,) = sizes
                    start = eol + 2
                    end = start + int(size)
                    if end + 2 > end_all:
                        partial = True
                        break
                    mid = start + int(hsize)
                    data_ = bytes(view[mid:end])
                    stats["in_msgs"] += 1
                    stats["in_bytes"] += end - mid
                    pos = end + 2
                    h(subject, reply, data_, bytes(view[start:mid]) if mid > start else None)
            finally:
                view.release()
            if pos:
                del buf[:pos]
        if not partial:  # a message cut at the end of the read waits here for its rest
            await parse()

    ps.parse = parse_fast


def parse_headers(block: bytes) -> dict:
    """A raw NATS header block (``NATS/1.0 ...`` then ``Key: value`` lines) as a dict, first value of each key."""
    out: dict = {}
    for line in block.decode("utf-8", "replace").split("\r\n")[1:]:
        k, sep, v = line.partition(":")
        if sep and (k := k.strip()) not in out:
            out[k] = v.strip()
    return out


def status_line(block: bytes) -> str:
    """The status and description of a raw header block (``NATS/1.0 409 Message Size Exceeds MaxBytes``)."""
    return block.split(b"\r\n", 1)[0].decode("utf-8", "replace").partition(" ")[2].strip()


@contextlib.contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """No cyclic garbage collection while a chunk is read (restored after, and at once).

    A chunk is up to :data:`isbflow.isb.read.CHUNK_MSGS` new tuples kept alive, so the collector ran every 700 of
    them, and its older generations walk every object of the process (a Spark worker holds
    pyspark, pyarrow and pandas). Measured on 200K events of ~140 B in one process holding
    those imports (four interleaved rounds, medians): 195K msg/s with collection on, 271K
    off. Nothing a read allocates forms a cycle; reference counting frees it as before, and
    the next collection sees what was left.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
