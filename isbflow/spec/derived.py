"""The names a pipeline's spec derives on JetStream, and the rule that they never collide.

A derived name is a pure function of the spec (:mod:`isbflow.isb.naming` builds every
stream, subject and bucket name from the functions here), so any process derives the
same name without asking anyone. Spec names may hold ``-`` and derived names join their
parts with ``-``, so two different spec entries can derive the same name (edges
``a -> b-c`` and ``a-b -> c`` of pipeline ``p`` both give stream ``isb-p-a-b-c-0``; a
reference table ``x-control`` of pipeline ``a`` gives the bucket that is the control
bucket of pipeline ``a-ref-x``). The scheme itself never changes (existing deployments
keep their stream names): instead :func:`collisions` finds every derived stream, subject
and bucket name claimed by two different entries of the specs loaded together, and
validation refuses the spec (:func:`isbflow.spec.load.load_specs`).

Subjects collide when a message could match both: equal subjects, or a subject that
falls under another stream's wildcard (the dead-letter stream takes ``isb.<p>.dlq.>``,
so a vertex named ``dlq`` with an output edge would feed it). A source stream named in
the spec with ``stream:`` belongs to its producers: several sources may read it (one
subject each), but it may not take a name isbflow derives for something else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from isbflow.spec.models import Pipeline

Loc = tuple[str | int, ...]
ClaimKind = Literal["stream", "subject", "bucket"]


# ------------------------------------------------------------------ the scheme


def edge_stream(pipeline: str, from_vertex: str, to_vertex: str, partition: int) -> str:
    return f"isb-{pipeline}-{from_vertex}-{to_vertex}-{partition}"


def edge_subject(pipeline: str, from_vertex: str, to_vertex: str, partition: int) -> str:
    return f"isb.{pipeline}.{from_vertex}.{to_vertex}.{partition}"


def source_stream(pipeline: str, vertex: str, named: str | None = None) -> str:
    """The stream of an external JetStream source: the one named in the spec, else ``src-<p>-<v>``."""
    return named or f"src-{pipeline}-{vertex}"


def dlq_stream(pipeline: str) -> str:
    return f"isb-{pipeline}-dlq"


def dlq_subject(pipeline: str, vertex: str) -> str:
    return f"isb.{pipeline}.dlq.{vertex}"


def dlq_subjects(pipeline: str) -> str:
    """The dead-letter stream's subjects (every vertex's :func:`dlq_subject`)."""
    return f"isb.{pipeline}.dlq.>"


def control_bucket(pipeline: str) -> str:
    return f"isbflow-{pipeline}-control"


def status_bucket(pipeline: str) -> str:
    return f"isbflow-{pipeline}-status"


def ledger_bucket(pipeline: str) -> str:
    return f"isbflow-{pipeline}-ledger"


def reference_bucket(pipeline: str, name: str) -> str:
    return f"isbflow-{pipeline}-ref-{name}"


# ------------------------------------------------------------------ isbflow's own namespace

#: prefixes of the streams isbflow derives (buffers and dead letters, source streams, KV buckets'
#: and object stores' streams): a spec's ``source.jetstream.stream`` may take none of them
RESERVED_STREAM_PREFIXES = ("isb-", "src-", "isbflow-", "KV_", "OBJ_")
#: prefixes of the subjects isbflow derives or NATS itself uses (buffers and dead letters, the
#: JetStream and KV APIs, every role's reply inbox): a spec's ``source.jetstream.subject`` may take none
RESERVED_SUBJECT_PREFIXES = ("isb.", "isbflow.", "$", "_INBOX")


def reserved(kind: Literal["stream", "subject"], name: str) -> str | None:
    """Why ``name`` may not be named in a spec as a ``kind`` (it lies in isbflow's own namespace,
    where every name belongs to some pipeline's derived resources); None when it may."""
    prefixes = RESERVED_STREAM_PREFIXES if kind == "stream" else RESERVED_SUBJECT_PREFIXES
    hit = next((p for p in prefixes if name.startswith(p) or name == p.rstrip("-.")), None)
    if hit is None:
        return None
    shown = ", ".join(f"'{p}'" for p in prefixes)
    what = ("isbflow derives every stream there (buffers, dead letters, source streams, KV buckets): "
            "naming one would hand this pipeline another pipeline's stream; leave 'stream' out to get "
            "the stream isbflow derives, or name your producers' own stream"
            if kind == "stream" else
            "those subjects are isbflow's buffers and dead letters, NATS' APIs and the roles' reply "
            "inboxes: publishing there would reach another pipeline; use your producers' own subject")
    return f"{name!r} is inside isbflow's own namespace (a {kind} may not start with {shown}): {what}"


# ------------------------------------------------------------------ claims


@dataclass(frozen=True)
class Claim:
    """One derived name and the spec entry it comes from.

    ``loc`` is the entry's path in its pipeline's document (``("spec", "edges", 1)``);
    ``what`` says what the name is for; two claims with the same ``identity`` are one
    resource named twice on purpose (a reference table joined by two steps), not a collision.
    An edge claims its partition 0 and holds ``partitions``: its partition ``n`` is the same
    name with ``n`` for the last part (see :func:`collisions`).
    """

    kind: ClaimKind
    name: str
    pipeline: str
    loc: Loc
    what: str
    identity: tuple
    partitions: int = 0  # an edge's partitions; 0 for any other claim

    def at(self, n: int) -> Claim:
        """This edge's claim of partition ``n``."""
        stem, sep = _stem(self)
        return replace(self, name=f"{stem}{sep}{n}", what=f"{self.what}, partition {n}", partitions=0)


def _stem(c: Claim) -> tuple[str, str]:
    """An edge name without its partition, and the separator before it."""
    sep = "-" if c.kind == "stream" else "."
    return c.name.rsplit(sep, 1)[0], sep


def claims(p: Pipeline) -> list[Claim]:
    """Every stream, subject and bucket name pipeline ``p`` derives, with the entry each comes from.

    One claim per edge (not per partition), so the claims grow with the spec, not with its partitions.
    """
    name = p.name
    out: list[Claim] = []
    meta: Loc = ("metadata", "name")
    parts = {v.name: v.partitions for v in p.spec.vertices}
    # the pipeline's own names first: a collision is then reported at the vertex or edge that meets them
    out.append(Claim("stream", dlq_stream(name), name, meta, "dead-letter stream", ("dlq", name)))
    out.append(Claim("subject", dlq_subjects(name), name, meta, "dead-letter subjects", ("dlq", name)))
    for role, bucket in (("control", control_bucket), ("status", status_bucket), ("ledger", ledger_bucket)):
        out.append(Claim("bucket", bucket(name), name, meta, f"{role} bucket", (role, name)))
    for i, v in enumerate(p.spec.vertices):
        js = v.source.jetstream if v.source is not None else None
        if js is not None:
            stream = source_stream(name, v.name, js.stream)
            where: Loc = ("spec", "vertices", i, "source", "jetstream")
            if js.stream:
                out.append(Claim("stream", stream, name, where + ("stream",), f"stream named by source {v.name}",
                                 ("named-stream", stream)))
            else:
                out.append(Claim("stream", stream, name, ("spec", "vertices", i, "name"),
                                 f"stream of source {v.name}", ("source", name, v.name)))
            out.append(Claim("subject", js.subject, name, where + ("subject",), f"subject of source {v.name}",
                             ("source-subject", stream, js.subject)))
        for k, ref in enumerate(v.udf.references if v.udf is not None else []):
            out.append(Claim("bucket", reference_bucket(name, ref.name), name,
                             ("spec", "vertices", i, "udf", "references", k, "name"),
                             f"reference table {ref.name}", ("reference", name, ref.name)))
    for j, e in enumerate(p.spec.edges):
        what, ident, n = f"buffer {e.from_} -> {e.to}", ("edge", name, e.from_, e.to), parts.get(e.to, 1)
        for kind, derive in (("stream", edge_stream), ("subject", edge_subject)):
            out.append(Claim(kind, derive(name, e.from_, e.to, 0), name, ("spec", "edges", j), what, ident,
                             partitions=n))
    return out


def collisions(all_claims: Sequence[Claim]) -> list[tuple[Claim, Claim]]:
    """(later, earlier) for each claim whose name another resource claimed first, in claim order.

    Names are compared exactly (an edge's partition ``n`` too); subjects also by overlap (a
    wildcard takes every subject under it). Time and memory grow with the number of claims.
    """
    out: list[tuple[Claim, Claim]] = []
    first: dict[tuple[str, str], Claim] = {}
    edges: dict[tuple[str, str], Claim] = {}  # (kind, stem) -> the first edge claiming it
    numbered: dict[tuple[str, str], list[tuple[int, Claim]]] = {}  # other names ending in a number, by stem
    subjects = _Subjects()

    def clash(c: Claim, o: Claim | None) -> bool:
        if o is not None and o.identity != c.identity and not _shared(o, c):
            out.append((c.at(0) if c.partitions else c, o.at(0) if o.partitions else o))
            return True
        return False

    for c in all_claims:
        key = (c.kind, c.name)
        if key in first:
            clash(c, first[key])
            continue
        first[key] = c
        if c.kind == "bucket":
            continue
        if c.partitions:  # an edge: its partitions 1.. against numbered names claimed before
            stem = (c.kind, _stem(c)[0])
            edges.setdefault(stem, c)
            hit = next(((n, o) for n, o in numbered.get(stem, ()) if 0 < n < c.partitions), None)
            if hit is not None and clash(c.at(hit[0]), hit[1]):
                continue
        else:
            sep = "-" if c.kind == "stream" else "."
            stem_, _, last = c.name.rpartition(sep)
            if last.isdigit() and stem_:
                numbered.setdefault((c.kind, stem_), []).append((int(last), c))
                edge = edges.get((c.kind, stem_))
                if edge is not None and 0 < int(last) < edge.partitions and clash(c, edge.at(int(last))):
                    continue
        if c.kind == "subject":
            clash(c, subjects.add(c))
    return out


def _shared(a: Claim, b: Claim) -> bool:
    """A stream named in the spec may be read by several sources (its producers own it)."""
    return a.identity[0] == b.identity[0] == "named-stream"


class _Subjects:
    """Subjects claimed so far, indexed by token prefix, to find an overlap in O(tokens).

    Subjects are literal or end in ``>`` (one or more tokens); a literal never equals another
    here (exact names are compared before).
    """

    def __init__(self) -> None:
        self.wild: dict[tuple[str, ...], Claim] = {}  # a wildcard's base (tokens before '>')
        self.under: dict[tuple[str, ...], Claim] = {}  # every proper prefix of a literal, or prefix of a base

    def add(self, c: Claim) -> Claim | None:
        """Record ``c``; the first earlier claim of another resource it overlaps, if any."""
        tokens = tuple(c.name.split("."))
        hit = None
        if tokens[-1] == ">":
            base = tokens[:-1]
            # an earlier wildcard whose base is a prefix of this base (or equal), or a longer one under it
            hit = next((w for k in range(1, len(base) + 1) if (w := self.wild.get(base[:k])) is not None
                        and w.identity != c.identity), None)
            if hit is None:
                o = self.under.get(base)
                hit = o if o is not None and o.identity != c.identity else None
            self.wild.setdefault(base, c)
            for k in range(1, len(base)):
                self.under.setdefault(base[:k], c)
        else:
            hit = next((w for k in range(1, len(tokens)) if (w := self.wild.get(tokens[:k])) is not None
                        and w.identity != c.identity), None)
            for k in range(1, len(tokens)):
                self.under.setdefault(tokens[:k], c)
        return hit
