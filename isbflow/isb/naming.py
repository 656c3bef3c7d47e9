"""Deterministic names of everything isbflow creates on JetStream.

A name is a pure function of the spec, so any process (a Spark executor, the
CLI, an Airflow worker) derives the same stream, subject or bucket without
asking anyone. Spec names are already restricted to ``[a-z0-9-]`` (see
:mod:`isbflow.spec.models`), which is safe in stream names, subjects and paths.
The scheme itself lives in :mod:`isbflow.spec.derived`, where validation also
checks that no two entries of the specs loaded together derive the same name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from isbflow.spec import derived

if TYPE_CHECKING:
    from isbflow.spec.models import Pipeline


@dataclass(frozen=True)
class EdgePartition:
    """One inter-step buffer: the stream of one partition of one edge."""

    pipeline: str
    from_vertex: str
    to_vertex: str
    partition: int

    @property
    def stream(self) -> str:
        return derived.edge_stream(self.pipeline, self.from_vertex, self.to_vertex, self.partition)

    @property
    def subject(self) -> str:
        return derived.edge_subject(self.pipeline, self.from_vertex, self.to_vertex, self.partition)


def edge_partitions(pipeline: Pipeline) -> list[EdgePartition]:
    """Every buffer of a pipeline: one per edge and partition of the edge's target."""
    out = []
    for e in pipeline.spec.edges:
        for p in range(pipeline.vertex(e.to).partitions):
            out.append(EdgePartition(pipeline.name, e.from_, e.to, p))
    return out


def source_stream(pipeline: Pipeline, vertex: str) -> str:
    """The stream holding an external JetStream source's subject."""
    v = pipeline.vertex(vertex)
    assert v.source and v.source.jetstream
    return derived.source_stream(pipeline.name, vertex, v.source.jetstream.stream)


def wake_subject(stream: str) -> str:
    """Where JetStream republishes the headers of each message ``stream`` stores (its RePublish, the
    message's own subject appended): what a step waiting for the stream to grow listens on
    (:mod:`isbflow.isb.wait`). A wildcard subject, as a subscription or a permission takes it."""
    return f"isbflow.wake.{stream}.>"


def dlq_stream(pipeline: str) -> str:
    return derived.dlq_stream(pipeline)


def dlq_subject(pipeline: str, vertex: str) -> str:
    return derived.dlq_subject(pipeline, vertex)


def dlq_subjects(pipeline: str) -> str:
    """The dead-letter stream's subjects: ``isb.<pipeline>.dlq.>``."""
    return derived.dlq_subjects(pipeline)


def control_bucket(pipeline: str) -> str:
    """KV: desired state per step (``running``, ``draining``, ``stopped``)."""
    return derived.control_bucket(pipeline)


def status_bucket(pipeline: str) -> str:
    """KV: heartbeats, offsets, rates and lag per step."""
    return derived.status_bucket(pipeline)


def ledger_bucket(pipeline: str) -> str:
    """KV: source offsets each sink has committed (the offset ledger)."""
    return derived.ledger_bucket(pipeline)


def reference_bucket(pipeline: str, name: str) -> str:
    """KV: a reference table (one value per key) joined by a step."""
    return derived.reference_bucket(pipeline, name)
