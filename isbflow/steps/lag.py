"""A pipeline's lag per buffer, measured from the buffers themselves.

The lag of a buffer (an edge partition stream, or a JetStream source stream)
is how many of its messages its reading step has not committed downstream
yet: the stream's last sequence minus the step's committed sequence
(``committed.<vertex>.<stream>`` in the status bucket, see
:mod:`isbflow.isb.state`). Unlike the heartbeat's ``lag``, it holds whether
or not the step runs, so "has the pipeline caught up?" has an answer after a
batch run or a drain too. A buffer that does not exist counts as lag 0 with
``missing: true`` (loss is the watchdog's business, not the lag's).

This module does not import Airflow.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from isbflow.isb import naming
from isbflow.isb.buffers import stream_state
from isbflow.isb.state import get_committed
from isbflow.spec.models import Pipeline


@dataclass(frozen=True)
class BufferLag:
    stream: str
    reader: str  # the step reading it
    last: int  # the stream's last sequence
    committed: int  # what the reader has committed (0: nothing yet)
    missing: bool = False

    @property
    def lag(self) -> int:
        return max(0, self.last - self.committed)

    def to_json(self) -> dict:
        return {**asdict(self), "lag": self.lag}


def buffers(p: Pipeline, sources: bool = True) -> dict[str, str]:
    """Stream -> the vertex reading it: every edge partition, plus JetStream source streams."""
    out = {ep.stream: ep.to_vertex for ep in naming.edge_partitions(p)}
    if sources:
        for v in p.spec.vertices:
            if v.source is not None and v.source.jetstream is not None:
                out[naming.source_stream(p, v.name)] = v.name
    return out


async def pipeline_lag(nc, p: Pipeline, sources: bool = True) -> list[BufferLag]:
    """The lag of every buffer of ``p`` (module docstring), in stream-name order."""

    out = []
    for stream, reader in sorted(buffers(p, sources).items()):
        st = await stream_state(nc, stream)
        if st is None:
            out.append(BufferLag(stream, reader, 0, 0, missing=True))
            continue
        committed = await get_committed(nc, p.name, reader, stream)
        # a step that never committed has consumed nothing of what the stream still holds
        base = committed if committed is not None else max(0, st.first_seq - 1)
        out.append(BufferLag(stream, reader, st.last_seq, base))
    return out
