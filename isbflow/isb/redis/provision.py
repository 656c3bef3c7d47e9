"""Provisioning a pipeline on a Redis store: its partitions and its ACL user.

What a pipeline owns is its grant (:class:`isbflow.isb.roles.PipelineGrant`, from its spec): its
edge partitions, source streams, dead-letter stream and buckets. :func:`apply`

- refuses a grant naming a stream another pipeline owns (a spec may not take another team's
  buffers), as recorded in ``<data dir>/redis/grants.json`` (each pipeline's last grant);
- creates each stream's incarnation when it has none (``created``), leaves one that has it
  (``unchanged``): a partition holds its frames across re-applies, and a stream that lost its
  incarnation (flushed, restarted without persistence) gets a new one, which readers holding the
  old one see as buffer loss;
- records the grant and makes the ACL users exactly those of every recorded grant
  (:func:`isbflow.isb.redis.acl.apply_users`): the pipeline's user reaches its own keys only.

Buckets need nothing made: a hash exists once it holds a key. An external server (no data dir)
gets the partitions only: its users are its operator's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isbflow.isb.redis.acl import apply_users
from isbflow.isb.redis.buffers import RedisBuffer
from isbflow.isb.redis.keys import kv_key
from isbflow.isb.redis.server import redis_dir, write_private
from isbflow.isb.roles import PipelineGrant

GRANTS_FILE = "grants.json"


class RedisProvisionRefused(Exception):
    """Nothing was provisioned: the message says why (a stream another pipeline owns)."""


@dataclass(frozen=True)
class Provisioned:
    """One stream of the grant and what :func:`apply` did to it: ``created`` or ``unchanged``."""

    stream: str
    action: str


def streams_of(grant: PipelineGrant) -> list[str]:
    """Every stream a pipeline owns: edge partitions, sources, dead letters."""
    return list(dict.fromkeys([*grant.buffers, *grant.sources, grant.dlq]))


def read_grants(data_dir: Path | str) -> list[PipelineGrant]:
    """The grants recorded under ``data_dir`` (none when nothing was provisioned there)."""
    path = redis_dir(data_dir) / GRANTS_FILE
    if not path.exists():
        return []
    return [PipelineGrant.from_json(d) for d in json.loads(path.read_text())]


def _owner_conflicts(grant: PipelineGrant, others: Sequence[PipelineGrant]) -> list[str]:
    mine = set(streams_of(grant))
    return [f"{s} (pipeline {o.pipeline})" for o in others if o.pipeline != grant.pipeline
            for s in streams_of(o) if s in mine]


async def apply(client: Any, grant: PipelineGrant, data_dir: Path | str | None = None) -> list[Provisioned]:
    """Provision ``grant``'s pipeline through the admin's ``client`` (module doc); what was done
    to each stream. Raises :class:`RedisProvisionRefused` before changing anything when the grant
    claims another pipeline's stream."""
    recorded = read_grants(data_dir) if data_dir is not None else []
    taken = _owner_conflicts(grant, recorded)
    if taken:
        raise RedisProvisionRefused(f"pipeline {grant.pipeline} may not use streams another pipeline owns: "
                                    f"{', '.join(taken)}; rename the source's stream in the spec")
    out = []
    for stream in streams_of(grant):
        buf = RedisBuffer(client, stream)
        held = await buf.state()
        if held is None:
            await buf.create()
        out.append(Provisioned(stream, "unchanged" if held is not None else "created"))
    if data_dir is not None:
        grants = [g for g in recorded if g.pipeline != grant.pipeline] + [grant]
        write_private(redis_dir(data_dir) / GRANTS_FILE, json.dumps([g.to_json() for g in grants], indent=1))
        await apply_users(client, data_dir, grants)
    return out


async def delete(client: Any, grant: PipelineGrant, data_dir: Path | str | None = None) -> list[str]:
    """Remove the pipeline's streams and buckets and, with ``data_dir``, its grant and user; the
    streams removed."""
    streams = streams_of(grant)
    for stream in streams:
        await RedisBuffer(client, stream).delete()
    await client.delete(*(kv_key(b) for b in [*grant.buckets]))
    if data_dir is not None:
        grants = [g for g in read_grants(data_dir) if g.pipeline != grant.pipeline]
        write_private(redis_dir(data_dir) / GRANTS_FILE, json.dumps([g.to_json() for g in grants], indent=1))
        await apply_users(client, data_dir, grants)
    return streams
