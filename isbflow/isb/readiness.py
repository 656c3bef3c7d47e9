"""When an embedded nats-server, or a cluster of them, is ready for clients.

:func:`isbflow.isb.server.start_embedded` waits for each node's ``/healthz``, then, for a cluster,
:func:`cluster_ready`: a JetStream meta leader that sees every peer current, every node knowing
every node's client URL (what clients learn and provisioning counts servers by), a JetStream
API request answered on each node, and a stream with a replica on every node created (and deleted).
Each step was seen missing on a busy 2-core machine right after the previous one held: an R3 stream
create timing out, a client seeing two servers of three, a first KV put answered "no responders",
and an R3 stream refused "no suitable peers for placement, peer offline" while the meta leader's
``/jsz`` showed every peer current and online (runs 42 and 44 of `.ci/run` here: whatever the leader
places replicas by, ``/jsz`` did not show it). Only creating one proves placement.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from isbflow.isb.server import NodeState, ServerState


def healthy(host: str, http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{http_port}/healthz", timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def meta_ready(host: str, nodes: list[NodeState]) -> bool:
    """Every node sees a JetStream meta leader, and the leader sees all its peers current and
    online: before that, creating an R3 stream can time out, or be refused "no suitable peers for
    placement, peer offline" (both seen on a busy 2-core machine, the second with every peer current)."""
    for n in nodes:
        try:
            with urllib.request.urlopen(f"http://{host}:{n.http_port}/jsz", timeout=1) as r:
                meta = json.load(r).get("meta_cluster") or {}
        except (urllib.error.URLError, OSError, ValueError):
            return False
        if not meta.get("leader"):
            return False
        if meta["leader"] == n.name and not all(p.get("current") and not p.get("offline")
                                                for p in meta.get("replicas") or []):
            return False
    return True


def gossiped(host: str, nodes: list[NodeState]) -> bool:
    """Every node knows every node's client URL (what a client learns from its INFO, and what
    provisioning counts servers by): before that, a client may see a cluster of two for a while."""
    for n in nodes:
        try:
            with urllib.request.urlopen(f"http://{host}:{n.http_port}/varz", timeout=1) as r:
                urls = json.load(r).get("connect_urls") or []
        except (urllib.error.URLError, OSError, ValueError):
            return False
        if len(set(urls)) < len(nodes):
            return False
    return True


def js_api_ready(state: ServerState) -> bool:
    """Every node answers a JetStream API request: just after the meta leader is elected a node can
    still answer "no responders" (seen as a cluster's first KV put failing on a busy machine)."""
    # lazy: the NATS client is needed here only; isb.settings imports isb.server, and so this module,
    # without it
    from isbflow.isb.connect import connect
    from isbflow.isb.settings import NatsSettings

    async def answers(url: str) -> bool:
        try:
            nc = await connect(NatsSettings(servers=(url,), tls_ca=state.ca_file), name="isbflow-nats-up",
                               timeout=2.0, reconnect_attempts=0)
        except Exception:  # noqa: BLE001 - not reachable yet: not ready
            return False
        try:
            await nc.request("$JS.API.INFO", b"", timeout=1.0)
            return True
        except Exception:  # noqa: BLE001 - no responders or a timeout: not ready
            return False
        finally:
            await nc.close()

    async def every() -> bool:
        return all(await asyncio.gather(*(answers(u) for u in state.urls)))

    with ThreadPoolExecutor(1) as pool:  # its own event loop, whether or not the caller runs one
        return pool.submit(asyncio.run, every()).result()


#: the stream :func:`placement_ready` creates and deletes (in memory, no subject a client uses)
PROBE_STREAM = "isbflow-ready-probe"


def placement_ready(state: ServerState) -> bool:
    """A memory stream with a replica on every node can be created (it is deleted at once): the
    module docstring's last condition."""
    # lazy: as in js_api_ready
    from nats.js.api import StorageType, StreamConfig

    from isbflow.isb.connect import connect
    from isbflow.isb.settings import NatsSettings

    async def probe() -> bool:
        try:
            nc = await connect(NatsSettings(servers=tuple(state.urls), tls_ca=state.ca_file), name="isbflow-nats-up",
                               timeout=2.0, reconnect_attempts=0)
        except Exception:  # noqa: BLE001 - not reachable yet: not ready
            return False
        js = nc.jetstream(timeout=5.0)
        try:
            await js.add_stream(StreamConfig(name=PROBE_STREAM, subjects=[f"_isbflow.ready.{PROBE_STREAM}"],
                                             storage=StorageType.MEMORY, num_replicas=len(state.nodes)))
        except Exception:  # noqa: BLE001 - "no suitable peers for placement", a timeout: not ready
            await nc.close()
            return False
        try:
            await js.delete_stream(PROBE_STREAM)
            return True
        except Exception:  # noqa: BLE001 - asked again: the create of an existing same stream succeeds
            return False
        finally:
            await nc.close()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, probe()).result()


def cluster_ready(host: str, state: ServerState) -> bool:
    """All of the module docstring's conditions, checked in that order (the cheap ones first)."""
    return (meta_ready(host, state.nodes) and gossiped(host, state.nodes) and js_api_ready(state)
            and placement_ready(state))
