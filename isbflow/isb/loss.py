"""Loss detection: is a buffer gone, recreated or trimmed past what its reader has read?

A partition stream is **lost** (docs/concepts/buffers.md) when it is missing, was
recreated (a new incarnation), or its first sequence moved past the offset its
reader has not yet read. The reader's progress is the last entry of its Spark
checkpoint's offset log (the ``jetstream`` source's offsets: per stream, the
incarnation and the last sequence read), so detection needs no running query.
:class:`DetectedLoss` is a finding; :class:`isbflow.isb.errors.BufferLost` is the
error a reader raises when it meets one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from isbflow.isb import naming
from isbflow.isb.buffers import stream_state
from isbflow.spec.models import Pipeline
from isbflow.spec.paths import DataDir


@dataclass(frozen=True)
class DetectedLoss:
    """A buffer found lost: its stream, why, and the lost sequences of the old incarnation."""

    stream: str
    reason: str
    #: first lost sequence of the old incarnation (None: unknown)
    first: int | None = None
    last: int | None = None



def checkpoint_offsets(ckpt: Path) -> dict[str, dict]:
    """Stream -> {"inc", "seq"} from the last entry of a query's offset log ({} if none)."""
    d = ckpt / "offsets"
    if not d.is_dir():
        return {}
    batches = sorted((int(f.name) for f in d.iterdir() if f.name.isdigit()), reverse=True)
    if not batches:
        return {}
    out: dict[str, dict] = {}
    for line in (d / str(batches[0])).read_text().splitlines()[2:]:
        try:
            o = json.loads(line)
        except ValueError:
            continue
        if isinstance(o, dict):
            out.update({s: v for s, v in o.items() if isinstance(v, dict) and "inc" in v and "seq" in v})
    return out


def stream_readers(p: Pipeline) -> dict[str, str]:
    """Stream -> the vertex reading it (edge partitions and JetStream source streams)."""
    out = {ep.stream: ep.to_vertex for ep in naming.edge_partitions(p)}
    for v in p.spec.vertices:
        if v.source is not None and v.source.jetstream is not None:
            out[naming.source_stream(p, v.name)] = v.name
    return out


async def detect_loss(nc, p: Pipeline, data_dir: Path) -> list[DetectedLoss]:
    """Every lost buffer of ``p``, judged against the readers' checkpoints."""
    lost = []
    ckroot = DataDir(data_dir).checkpoints(p.name)
    for stream, reader in stream_readers(p).items():
        st = await stream_state(nc, stream)
        seen: dict | None = None
        for ck in sorted(ckroot.glob(f"{reader}*")) if ckroot.is_dir() else []:
            if ck.name == reader or ck.name.startswith(f"{reader}-to-"):
                o = checkpoint_offsets(ck).get(stream)
                if o is not None and (seen is None or int(o["seq"]) < int(seen["seq"])):
                    seen = o
        read_to = int(seen["seq"]) if seen else None
        if st is None:
            lost.append(DetectedLoss(stream, "the stream no longer exists",
                                   None if read_to is None else read_to + 1))
        elif seen is not None and seen["inc"] != st.incarnation:
            lost.append(DetectedLoss(stream, f"the stream was recreated (incarnation {seen['inc']} is gone, "
                                           f"now {st.incarnation})", read_to + 1))
        elif read_to is not None and st.first_seq > read_to + 1:
            lost.append(DetectedLoss(stream, "the stream's first sequence moved past the offset not yet read",
                                   read_to + 1, st.first_seq - 1))
    return lost
