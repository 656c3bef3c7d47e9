"""The buffer verbs: apply a spec's buffers, diff them, show their state, delete them.

Called by ``isbflow isb ...``, the ``isb_provision`` DAG's operator and the pipeline verbs.
Synchronous wrappers of :mod:`isbflow.isb.provision` (see it for the contract).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from isbflow.isb import provision
from isbflow.isb.connect import IsbSettings, NatsSettings, RedisSettings, connect, default_data_dir
from isbflow.isb.connect import IsbUnreachable as Unreachable
from isbflow.isb.owners import OwnershipRefused
from isbflow.isb.provision import (
    Action,
    ChangeClass,
    Drift,
    ProvisionError,
    ProvisionRefused,
    ProvisionReport,
    ResourceResult,
    StreamStatus,
    desired_resources,
)
from isbflow.isb.provision_partitions import extra_partitions
from isbflow.isb.roles import READER, PipelineGrant, pipeline_grants
from isbflow.isb.server import (
    check_grantable,
    grant_pipelines,
    read_grants,
    read_state,
    role_password_file,
)
from isbflow.ops.isb_service import require_jetstream
from isbflow.spec import Specs
from isbflow.spec.models import Pipeline

__all__ = ["READER", "Action", "ChangeClass", "Drift", "OwnershipRefused", "ProvisionError", "ProvisionRefused", "ProvisionReport", "StreamStatus",
           "Unreachable", "apply", "delete", "diff", "grant", "granted", "role_settings", "planned_count", "status"]


def apply(settings: NatsSettings, specs: Specs, pipeline: str | None = None, *, recreate: bool = False,
          force: bool = False, data_dir: Path | None = None) -> ProvisionReport:
    """Make the server hold the buffers the spec asks for (idempotent, all or nothing).

    Raises :class:`ProvisionRefused` when a change is refused (nothing applied): a recreate
    without ``recreate``, or without ``force`` a recreate of a stream holding messages or a
    change that may discard unread messages; or when the pipeline would claim a stream or subject
    another pipeline owns (:mod:`isbflow.isb.owners`: the embedded server's grants, the streams'
    metadata). With ``data_dir``, an embedded server recorded there must run with the store limits
    the spec sets.
    """
    grants = pipeline_grants(specs.select(pipeline))
    if isinstance(settings, RedisSettings):
        return _apply_redis(settings, grants, data_dir)
    try:  # what grant() would refuse, refused before anything is provisioned
        check_grantable(data_dir or default_data_dir(), [grants])
    except OwnershipRefused as e:
        raise ProvisionRefused(str(e), ProvisionReport(grants.pipeline)) from None
    report = asyncio.run(provision.apply(settings, specs, pipeline, recreate=recreate, force=force,
                                         data_dir=data_dir))
    grant(specs.pipelines[report.pipeline], data_dir)
    return report


def _apply_redis(settings: RedisSettings, grants: PipelineGrant, data_dir: Path | None) -> ProvisionReport:
    """:func:`apply` on a Redis store (:mod:`isbflow.isb.redis.provision`): the pipeline's streams,
    and its ACL user when the store is the embedded one under ``data_dir``."""
    # lazy: JetStream-only commands never import redis-py
    from isbflow.isb.redis.provision import RedisProvisionRefused
    from isbflow.isb.redis.provision import apply as redis_apply
    from isbflow.isb.redis.server import serving

    own = data_dir or default_data_dir()
    embedded = serving(own, settings.url) is not None

    async def go() -> list:
        store = await connect(settings, name="isbflow-provision")
        try:
            return await redis_apply(store.client, grants, own if embedded else None)
        finally:
            await store.close()

    try:
        done = asyncio.run(go())
    except RedisProvisionRefused as e:
        raise ProvisionRefused(str(e), ProvisionReport(grants.pipeline)) from None
    action = {"created": Action.CREATED, "unchanged": Action.UNCHANGED}
    return ProvisionReport(grants.pipeline, [ResourceResult(d.stream, "stream", action[d.action]) for d in done])


def _jetstream_only(specs: Specs, pipeline: str | None, what: str) -> None:
    for p in [specs.select(pipeline)] if pipeline else specs.pipelines.values():
        require_jetstream(specs.service_for(p), what)


def grant(pipeline: Pipeline, data_dir: Path | None = None) -> bool:
    """Give ``pipeline`` its user (``pipeline-<name>``), its source subjects to the producer
    and its buckets to the reader on the embedded server under ``data_dir`` (default: the usual
    data dir), which reloads them (:func:`isbflow.isb.server.grant_pipelines`). False when no
    embedded server with auth runs there: an external server's users are its operator's (docs/operations/nats-roles.md)."""
    return grant_pipelines(data_dir or default_data_dir(), [pipeline_grants(pipeline)])


def granted(data_dir: Path, pipeline: str) -> bool:
    """Whether pipeline ``pipeline`` is granted its users on the embedded server under ``data_dir``."""
    return any(g.pipeline == pipeline for g in read_grants(data_dir))


def role_settings(settings: IsbSettings, data_dir: Path, user: str) -> IsbSettings:
    """``settings`` logged in as role ``user`` (:mod:`isbflow.isb.roles`) when they point at the
    embedded server under ``data_dir`` and it has that user; else ``settings`` unchanged (an
    external server: its operator hands out the credentials). The same for a Redis store's ACL users."""
    if isinstance(settings, RedisSettings):
        # lazy: JetStream-only commands never import redis-py
        from isbflow.isb.redis.acl import password_file
        from isbflow.isb.redis.server import serving

        rpw = password_file(data_dir, user)
        if serving(data_dir, settings.url) is None or not rpw.exists():
            return settings
        return replace(settings, user=user, password=rpw.read_text().strip())
    state = read_state(data_dir)
    plain = settings.with_auth_from_urls()
    pw = role_password_file(data_dir, user)
    if state is None or not state.user or plain.servers != tuple(state.plain_urls) or not pw.exists():
        return settings
    return replace(plain, user=user, password=pw.read_text().strip(), token=None, creds_file=None,
                   inbox_prefix=None)


def diff(settings: NatsSettings, specs: Specs, pipeline: str | None = None, *,
         data_dir: Path | None = None) -> list[Drift]:
    """Every difference, each with the class its change would have now; changes nothing.

    With ``data_dir``, the embedded server recorded there is checked for the spec's store limits too.
    """
    if isinstance(settings, RedisSettings):
        return asyncio.run(_redis_diff(settings, specs, pipeline))
    _jetstream_only(specs, pipeline, "the buffer diff")
    return asyncio.run(provision.diff(settings, specs, pipeline, data_dir=data_dir))


def status(settings: IsbSettings, specs: Specs, pipeline: str | None = None) -> list[StreamStatus]:
    if isinstance(settings, RedisSettings):
        return asyncio.run(_redis_status(settings, specs, pipeline))
    return asyncio.run(provision.status(settings, specs, pipeline))


def delete(settings: IsbSettings, specs: Specs, pipeline: str | None = None,
           data_dir: Path | None = None) -> list[str]:
    """Remove the pipeline's buffers (and on Redis its buckets and, embedded under ``data_dir``,
    its ACL user); the names removed."""
    if isinstance(settings, RedisSettings):
        return asyncio.run(_redis_delete(settings, specs, pipeline, data_dir or default_data_dir()))
    return asyncio.run(provision.delete(settings, specs, pipeline))


def _pipelines(specs: Specs, pipeline: str | None) -> list[Pipeline]:
    return [specs.select(pipeline)] if pipeline else list(specs.pipelines.values())


async def _redis_status(settings: RedisSettings, specs: Specs, pipeline: str | None) -> list[StreamStatus]:
    """Each Redis stream of the pipelines: frames held, first and last offset (missing: ``exists`` False)."""
    # lazy: JetStream-only commands never import redis-py
    from isbflow.isb.redis.provision import streams_of

    store = await connect(settings, name="isbflow-isb-status")
    try:
        out = []
        for p in _pipelines(specs, pipeline):
            for stream in streams_of(pipeline_grants(p)):
                st = await store.buffers().state(stream)
                out.append(StreamStatus(stream, "stream", st is not None, **(
                    {"messages": st.messages, "first_seq": st.first_seq, "last_seq": st.last_seq} if st else {})))
        return out
    finally:
        await store.close()


async def _redis_diff(settings: RedisSettings, specs: Specs, pipeline: str | None) -> list[Drift]:
    """:func:`diff` on a Redis store: each stream of the pipelines the store lacks (``isb apply``
    creates it), and the partitions it holds beyond a vertex's ``partitions`` (a rescale removes
    them). A Redis stream has no configuration to drift: its limits are the pipeline's spec."""
    # lazy: JetStream-only commands never import redis-py
    from isbflow.isb.redis.provision import streams_of

    store = await connect(settings, name="isbflow-isb-diff")
    try:
        out: list[Drift] = []
        for p in _pipelines(specs, pipeline):
            out += [Drift(s, "stream", "exists", True, False) for s in streams_of(pipeline_grants(p))
                    if await store.buffers().state(s) is None]
            out += await extra_partitions(store, p)
        return out
    finally:
        await store.close()


async def _redis_delete(settings: RedisSettings, specs: Specs, pipeline: str | None, data_dir: Path) -> list[str]:
    # lazy: JetStream-only commands never import redis-py
    from isbflow.isb.redis.provision import delete as redis_delete
    from isbflow.isb.redis.server import serving

    embedded = serving(data_dir, settings.url) is not None
    store = await connect(settings, name="isbflow-isb-delete")
    try:
        out = []
        for p in _pipelines(specs, pipeline):
            out += await redis_delete(store.client, pipeline_grants(p), data_dir if embedded else None)
        return out
    finally:
        await store.close()


def planned_count(specs: Specs, pipeline: str | None = None) -> int:
    """How many streams and buckets the pipeline owns."""
    return len(desired_resources(specs, pipeline))
