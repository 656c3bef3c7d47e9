"""The embedded server a spec's buffers live on, checked against the spec for ``isbflow isb apply``/``diff``:
its servers (:func:`servers_reporting`), its store limits (:func:`store_drift`) and ``jetstream.encryption`` (:func:`cipher_drift`).

The embedded server's cipher is what isbflow recorded starting it (nats-server reports it to no
client: :mod:`isbflow.isb.encryption`). When the spec asks for another one (encryption turned
on or off, as Numaflow's docs put it: delete the service and create it again):

- a server holding no stream is restarted with the spec's cipher (nothing to recreate);
- otherwise, without ``force``, :func:`toggle_refusal` refuses, naming the field;
- with ``force``, the buffers are recreated only once drained: refused while a stream of the
  pipeline holds unread messages (or the dead-letter stream any letter), or while the server
  holds streams that are not the pipeline's (a restart would leave them unreadable, or encrypt
  them behind their owner's back); else the pipeline's streams and buckets are deleted, the
  server restarted with the spec's cipher (:func:`restart`: same nodes, ports, users and limits),
  and everything created again empty.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from nats.js.errors import NotFoundError

from isbflow.isb import encryption
from isbflow.isb.connect import NatsSettings
from isbflow.isb.server import (
    HOST,
    EmbeddedNatsError,
    ServerState,
    read_state,
    start_embedded,
    stop_embedded,
)
from isbflow.spec.load import Specs

if TYPE_CHECKING:
    import nats.aio.client
    from nats.js import JetStreamContext

    from isbflow.isb.provision_plan import ResourcePlan


def embedded_state(settings: NatsSettings, data_dir: Path | str | None) -> ServerState | None:
    """The embedded nats-server recorded under ``data_dir`` when ``settings`` point at it and all its
    nodes run; None otherwise (no data dir, no such server, an external server)."""
    if data_dir is None:
        return None
    try:
        state = read_state(data_dir)
    except EmbeddedNatsError:
        return None
    if state is None or not state.nodes or not all(state.alive()):
        return None
    ports = {urlsplit(u if "://" in u else f"nats://{u}").port for u in settings.servers}
    return state if ports and ports <= {n.client_port for n in state.nodes} else None


STORE_LIMITS = ("max_memory_store", "max_file_store")


def embedded_limits(settings: NatsSettings, data_dir: Path | str | None) -> dict[str, int] | None:
    """``max_memory_store``/``max_file_store`` of the embedded nats-server recorded under
    ``data_dir`` (its monitoring endpoint), when ``settings`` point at it; None otherwise
    (no data dir, no such server, an external server)."""
    if (state := embedded_state(settings, data_dir)) is None:
        return None
    try:
        with urllib.request.urlopen(f"http://{HOST}:{state.nodes[0].http_port}/jsz", timeout=5) as r:
            config = json.load(r).get("config") or {}
    except (OSError, ValueError):
        return None
    return {"max_memory_store": config.get("max_memory"), "max_file_store": config.get("max_storage")}


def store_drift(specs: Specs, pipeline: str, limits: dict[str, int] | None) -> list[tuple[str, int, int]]:
    """(field, spec, server) for each store limit the spec sets that the embedded server does not run with."""
    settings = specs.service_for(specs.select(pipeline)).spec.jetstream.settings
    out = []
    for f in STORE_LIMITS:
        want, have = getattr(settings, f), (limits or {}).get(f)
        if f in settings.model_fields_set and want > 0 and have is not None and have != want:
            out.append((f, want, have))
    return out


def server_count(nc: nats.aio.client.Client) -> int | None:
    """JetStream servers of the service, from the connected server's INFO (the client URLs of
    its cluster, gossiped); 1 for a server outside a cluster; None when a cluster does not say."""
    info = getattr(nc, "_server_info", None) or {}
    urls = info.get("connect_urls") or []
    if urls:
        return len(set(urls))
    return None if info.get("cluster") else 1


#: how long apply waits for a just-started cluster to report all its servers
SERVERS_WAIT_S = 10.0


async def servers_reporting(nc: nats.aio.client.Client, wanted: int, wait: float = SERVERS_WAIT_S) -> int | None:
    """:func:`server_count`, waiting up to ``wait`` seconds for it to reach ``wanted``: a cluster
    that just started gossips its members' URLs while its routes form (the client learns them
    from the server's INFO updates)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while True:
        count = server_count(nc)
        clustered = bool((getattr(nc, "_server_info", None) or {}).get("cluster"))
        if count is None or count >= wanted or not clustered or loop.time() >= deadline:
            return count
        await asyncio.sleep(0.2)


def wanted_cipher(specs: Specs, pipeline: str) -> str:
    """The cipher the pipeline's ISB service asks for, :data:`~isbflow.isb.encryption.PLAIN` when none."""
    jet = specs.service_for(specs.select(pipeline)).spec.jetstream
    return jet.cipher if jet.encryption else encryption.PLAIN


def cipher_drift(specs: Specs, pipeline: str, state: ServerState | None) -> tuple[str, str] | None:
    """(spec, server) ciphers when the embedded server ``state`` runs with another one than the spec's."""
    if state is None:
        return None
    want = wanted_cipher(specs, pipeline)
    return None if want == state.cipher else (want, state.cipher)


def _words(cipher: str) -> str:
    return "off" if cipher == encryption.PLAIN else f"on ({cipher})"


async def stream_names(nc: nats.aio.client.Client) -> list[str]:
    """Every stream on the server (KV buckets' streams included)."""
    names: list[str] = []
    while True:
        reply = json.loads((await nc.request("$JS.API.STREAM.NAMES", json.dumps({"offset": len(names)}).encode(),
                                             timeout=10)).data)
        names.extend(reply.get("streams") or [])
        if not reply.get("streams") or len(names) >= reply.get("total", 0):
            return names


async def toggle_refusal(nc: nats.aio.client.Client, plans: list[ResourcePlan], drift: tuple[str, str],
                         state: ServerState, force: bool, where: str) -> str:
    """Why the embedded server may not be restarted with the spec's cipher now ("" when it may)."""
    want, have = drift
    names = await stream_names(nc)
    if not names:
        return ""
    head = (f"refused, nothing was applied: jetstream.encryption is {_words(want)} in the spec but the embedded "
            f"nats-server at {where} runs with it {_words(have)}")
    if not force:
        return (f"{head}; changing it recreates every buffer and bucket of the pipeline, empty: drain the "
                "pipeline ('isbflow pipeline drain -f SPEC'), then re-run with --force (refused while a buffer "
                "holds unread messages)")
    if not state.start_args:
        return f"{head}; the server was started before isbflow recorded how: restart it once ('isbflow nats down', then 'isbflow nats up') and re-run"
    held = [f"  {p.resource.name}: {p.holding.unread} unread" for p in plans
            if p.exists and p.resource.kind == "stream" and p.resource.labels.get("isbflow.role") != "dlq"
            and p.holding.unread]
    held += [f"  {p.resource.name}: {p.holding.messages} dead letter(s)" for p in plans
             if p.exists and p.resource.labels.get("isbflow.role") == "dlq" and p.holding.messages]
    if held:
        return (f"{head}; --force recreates the buffers only once drained, and these hold data:\n"
                + "\n".join(held) + "\n  -> drain the pipeline ('isbflow pipeline drain -f SPEC'), replay or "
                "remove its dead letters, and re-run")
    ours = {p.resource.stream for p in plans if p.resource.managed}  # a named source stream is its producers'
    others = sorted(n for n in names if n not in ours)
    if others:
        return (f"{head}; the server also holds streams that are not this pipeline's ({', '.join(others[:8])}"
                f"{', ...' if len(others) > 8 else ''}): restarting it with another cipher would "
                f"{'leave them unreadable' if want == encryption.PLAIN else 'change them too'}; delete them "
                "(or apply on a server of this pipeline's own) and re-run")
    return ""


async def drop(js: JetStreamContext, plans: list[ResourcePlan]) -> None:
    """Delete the pipeline's streams and buckets that exist (drained: :func:`toggle_refusal`)."""
    for p in plans:
        if p.exists and p.resource.managed:
            try:
                await js.delete_stream(p.resource.stream)
            except NotFoundError:
                pass


def restart(state: ServerState, cipher: str) -> ServerState:
    """Stop the embedded server ``state`` and start it as it was started, with ``cipher``."""
    stop_embedded(state.data_dir)
    return start_embedded(state.data_dir, **state.start_args, cipher=cipher)


def recreated_message(drift: tuple[str, str]) -> str:
    return f"recreated: encryption at rest {_words(drift[1])} -> {_words(drift[0])}"
