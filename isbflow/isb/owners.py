"""Who owns a stream or subject on the ISB service, and the refusal of a claim another pipeline holds.

Validation refuses specs loaded together that claim one name (:func:`isbflow.spec.derived.collisions`)
and any spec naming a stream or subject inside isbflow's own namespace
(:func:`isbflow.spec.derived.reserved`). Specs applied one by one are checked here, against
what the service already records as owned, with the same collision rule:

- the **grants** of the embedded server (``<data dir>/nats/grants.json``): every stream, bucket
  and source subject each pipeline's user was granted (:func:`grant_claims`);
  :func:`isbflow.isb.server.grant_pipelines` refuses a grant holding what another pipeline holds;
- the **stream metadata** of any server (``isbflow.pipeline``, written when isbflow creates a
  stream): :func:`isbflow.isb.provision.apply` refuses a spec whose source names a stream, or
  whose source subject falls on a stream, that another pipeline's metadata names
  (:func:`server_claims`).

A stream a spec names with ``stream:`` and that isbflow did not create for another pipeline
belongs to its producers: several pipelines may read it (as in validation).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from isbflow.spec import derived
from isbflow.spec.derived import Claim

if TYPE_CHECKING:
    from isbflow.isb.roles import PipelineGrant

#: the metadata key naming the pipeline a stream was created for
PIPELINE_KEY = "isbflow.pipeline"


class OwnershipRefused(Exception):
    """A pipeline claims a stream or subject another pipeline owns; the message names each one and its owner."""


def _source_identity(pipeline: str, stream: str) -> tuple:
    """A spec-named stream (outside the reserved namespace) is its producers' and may be shared."""
    if derived.reserved("stream", stream) is None:
        return ("named-stream", stream)
    return ("source", pipeline, stream)


def grant_claims(g: PipelineGrant) -> list[Claim]:
    """What a grant gives its pipeline's user, as claims (one per stream, bucket and source subject)."""
    p, loc = g.pipeline, ("grant",)
    out = [Claim("stream", s, p, loc, "buffer", ("grant", p, s)) for s in g.buffers]
    out.append(Claim("stream", g.dlq, p, loc, "dead-letter stream", ("grant", p, g.dlq)))
    out += [Claim("stream", s, p, loc, "source stream", _source_identity(p, s)) for s in g.sources]
    out += [Claim("bucket", b, p, loc, "bucket", ("grant", p, b)) for b in (*g.buckets, *g.references)]
    # a source subject is one stream's: its identity follows the stream (one source per subject)
    streams = dict(zip(g.source_subjects, g.sources, strict=False))
    out += [Claim("subject", s, p, loc, "source subject", ("source-subject", streams.get(s, ""), s))
            for s in g.source_subjects]
    return out


def server_claims(configs: Iterable[tuple[str, Sequence[str], dict[str, str] | None]]) -> list[Claim]:
    """The claims of streams on a server whose metadata names a pipeline: ``(name, subjects, metadata)``
    each; a KV bucket's stream (``KV_<bucket>``) claims its bucket."""
    out = []
    for name, subjects, meta in configs:
        owner = (meta or {}).get(PIPELINE_KEY)
        if not owner:
            continue
        role = (meta or {}).get("isbflow.role", "stream")
        loc = ("server",)
        if name.startswith("KV_"):
            out.append(Claim("bucket", name[3:], owner, loc, f"{role} bucket", ("server", owner, name)))
            continue
        out.append(Claim("stream", name, owner, loc, f"{role} stream", _source_identity(owner, name)
                         if role == "source" else ("server", owner, name)))
        out += [Claim("subject", s, owner, loc, f"subject of its {role} stream {name}",
                      ("source-subject", name, s) if role == "source" else ("server", owner, name, s))
                for s in subjects or ()]
    return out


def foreign(mine: Sequence[Claim], held: Sequence[Claim]) -> list[str]:
    """One line per claim of ``mine`` that a claim of ``held`` by another pipeline collides with
    (:func:`isbflow.spec.derived.collisions`: equal names, a subject under another's wildcard, an
    edge's partitions), naming the owner."""
    pipelines = {c.pipeline for c in mine}
    found = derived.collisions([*[c for c in held if c.pipeline not in pipelines], *mine])
    lines = []
    for c, o in found:
        if c.pipeline in pipelines and o.pipeline not in pipelines:
            verb = "is" if c.name == o.name else f"overlaps {o.name!r},"
            lines.append(f"{c.kind} {c.name!r} ({c.what} of pipeline {c.pipeline}) {verb} owned by "
                         f"pipeline {o.pipeline} ({o.what})")
    return list(dict.fromkeys(lines))


def check_grants(grants: Sequence[PipelineGrant], held: Sequence[PipelineGrant]) -> None:
    """Refuse ``grants`` when one holds a stream, bucket or source subject that another pipeline's
    grant in ``held`` (or another of ``grants``) holds: :class:`OwnershipRefused` naming each one
    and its owner. A pipeline's own earlier grant is replaced, never in the way."""
    lines: list[str] = []
    taken = {g.pipeline for g in grants}
    before = [c for g in held if g.pipeline not in taken for c in grant_claims(g)]
    for g in grants:
        mine = grant_claims(g)
        lines += [f"  {line}" for line in foreign(mine, before)]
        before += mine
    if lines:
        raise OwnershipRefused(
            "refused, nothing was granted: a pipeline's user would reach streams or subjects another "
            "pipeline owns:\n" + "\n".join(lines) + "\n  -> rename the pipeline's sources, edges or streams "
            "so that it claims only its own names (isbflow validate -f A -f B checks specs together)")
