"""A spec's ISB service, whichever store it uses: start and stop its embedded server
(``isbflow isb up/down -f SPEC``), and refuse to run pipelines on a store they cannot run on yet.

- ``jetstream`` with ``url: embedded``: the nats-server ``isbflow nats up`` starts
  (:func:`isbflow.isb.server.start_embedded`), with the spec's ``jetstream.replicas`` as its node count
  (1 when unset), its ``settings`` store limits and its ``encryption``/``cipher``;
- ``redis.native``: Debian's redis-server (:func:`isbflow.isb.redis.server.start_redis`) with the spec's
  ``persistence`` and ``fsync``, then its ``settings.redis`` lines applied with ``CONFIG SET``;
- an external service (``jetstream.url``, ``redis.external``): refused, isbflow starts nothing.

A second ``up`` reuses the live server (and applies ``settings.redis`` again). :func:`require_jetstream`
refuses, in one line naming it, a verb that does not serve Redis buffers yet (reprocessing and
shadow runs, rescaling, scale to zero, the buffer diff).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isbflow.isb import encryption
from isbflow.isb.connect import IsbUnreachable
from isbflow.isb.server import EmbeddedNatsError, ServerState, start_embedded, stop_embedded
from isbflow.isb.server import read_state as read_nats_state
from isbflow.spec import SpecError, SpecProblem, Specs
from isbflow.spec.models import InterStepBufferService

if TYPE_CHECKING:
    from isbflow.isb.redis.server import RedisServerState

__all__ = ["IsbServiceError", "NotRunnable", "ServiceDown", "ServiceUp", "down", "pick_service",
           "require_jetstream", "up"]

#: what every refusal of a verb on a Redis service says
NOT_ON_REDIS = "is not available on Redis buffers yet"


class IsbServiceError(Exception):
    """Nothing was started or stopped (the message says why). ``external``: the service is one isbflow
    does not start."""

    def __init__(self, message: str, external: bool = False) -> None:
        super().__init__(message)
        self.external = external


class NotRunnable(IsbUnreachable):
    """A verb asked of a pipeline whose service is on a store the verb does not serve yet (one line)."""


def require_jetstream(service: InterStepBufferService | None, what: str) -> None:
    """Raise :class:`NotRunnable` when ``service`` keeps its buffers in Redis and ``what`` (a verb:
    "rescaling", "scale to zero", ...) works on JetStream buffers only. A pipeline on Redis
    runs (provisioning, start, run, drain, status, produce, quality); what is refused names itself."""
    if service is not None and service.store == "redis":
        raise NotRunnable(f"{what} {NOT_ON_REDIS}: ISB service {service.name!r} keeps its buffers in Redis "
                          "(spec.redis); run it on a jetstream service")


def pick_service(specs: Specs, service: str | None = None, pipeline: str | None = None) -> InterStepBufferService:
    """The service named ``service``; else the pipeline's (``pipeline``, or the only one); else the only
    service the files declare. Raises :class:`SpecError` saying which to name."""
    files = ", ".join(sorted(set(specs.files.values())))
    if service is not None:
        if service not in specs.services:
            known = ", ".join(sorted(specs.services))
            raise SpecError([SpecProblem(files, "", f"no InterStepBufferService named {service!r} (found: {known})")])
        return specs.services[service]
    if pipeline is not None or specs.pipelines:
        return specs.service_for(specs.select(pipeline))
    declared = sorted(k.split("/", 1)[1] for k in specs.files if k.startswith("InterStepBufferService/"))
    if len(declared) != 1:
        raise SpecError([SpecProblem(files, "", f"{len(declared)} InterStepBufferServices ({', '.join(declared)}): "
                                     "name one with --service")])
    return specs.services[declared[0]]


@dataclass
class ServiceUp:
    """A running embedded service: the store's server state and whether it was started now."""

    service: str
    store: str
    started: bool
    data_dir: Path
    nats: ServerState | None = None
    redis: RedisServerState | None = None
    #: ``settings.redis`` as applied (``CONFIG SET``)
    settings: dict[str, str] = field(default_factory=dict)
    #: ``appendfsync`` of a Redis server with persistence, None without
    fsync: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Without secrets: URLs without credentials, the password's file, never the password."""
        head = {"service": self.service, "store": self.store, "started": self.started, "data_dir": str(self.data_dir)}
        if self.nats is not None:
            return {**head, **self.nats.to_json(with_secrets=False)}
        r = self.redis
        assert r is not None
        return {**head, "pid": r.pid, "port": r.port, "url": redis_url(r), "user": "default",
                "password_file": str(Path(r.config).parent / "password"), "persistence": r.persistence,
                "fsync": self.fsync, "settings": self.settings, "log": r.log, "alive": r.alive()}


@dataclass
class ServiceDown:
    service: str
    store: str
    #: PIDs signalled; empty when nothing was recorded
    stopped: list[int]

    def to_json(self) -> dict[str, Any]:
        return {"service": self.service, "store": self.store, "stopped": self.stopped}


def redis_url(state: RedisServerState) -> str:
    """The embedded redis-server's URL, without credentials."""
    return f"redis://127.0.0.1:{state.port}"


def _external(service: InterStepBufferService) -> str | None:
    """Why isbflow starts nothing for ``service`` (its URL), None for an embedded one."""
    if service.spec.redis is not None:
        ext = service.spec.redis.external
        return None if ext is None else f"redis.external.url {ext.url}"
    url = service.spec.jetstream.url
    return None if url == "embedded" else f"jetstream.url {url}"


def _refuse_external(service: InterStepBufferService) -> None:
    where = _external(service)
    if where is not None:
        raise IsbServiceError(f"ISB service {service.name!r} is external ({where}): isbflow starts nothing; "
                              "that server is started and stopped by its operator", external=True)


def up(service: InterStepBufferService, data_dir: Path) -> ServiceUp:
    """Start ``service``'s embedded server under ``data_dir``, or reuse the live one (module doc).
    Raises :class:`IsbServiceError`."""
    _refuse_external(service)
    if service.store == "redis":
        return _redis_up(service, data_dir)
    jet = service.spec.jetstream
    try:
        before = read_nats_state(data_dir)
        reused = before is not None and all(before.alive())
        state = start_embedded(data_dir, cluster=jet.replicas or 1, auth=True, max_payload=jet.settings.max_payload,
                               max_memory_store=jet.settings.max_memory_store,
                               max_file_store=jet.settings.max_file_store,
                               cipher=jet.cipher if jet.encryption else encryption.PLAIN)
    except EmbeddedNatsError as e:
        raise IsbServiceError(str(e)) from None
    return ServiceUp(service.name, "jetstream", not reused, data_dir, nats=state)


def _redis_up(service: InterStepBufferService, data_dir: Path) -> ServiceUp:
    # lazy: redis-py (~0.3 s) is loaded for a Redis service only; ops.connection imports this module
    import redis

    from isbflow.isb.redis import server

    native = service.spec.redis.native  # type: ignore[union-attr]
    assert native is not None
    try:
        before = server.read_state(data_dir)
        reused = before is not None and before.alive()
        state = server.start_redis(data_dir, persistence="aof" if native.persistence else "none", fsync=native.fsync)
    except server.EmbeddedRedisError as e:
        raise IsbServiceError(str(e)) from None
    settings = dict(native.settings.directives)
    fsync = native.fsync if native.persistence else None
    applied = {**settings, **({"appendfsync": fsync} if fsync else {})}  # a reused server takes the spec's fsync too
    if applied:
        client = redis.Redis(host=server.HOST, port=state.port, password=state.password, socket_timeout=10)
        try:
            client.execute_command("CONFIG", "SET", *(x for kv in applied.items() for x in kv))
        except redis.RedisError as e:
            if not reused:
                server.stop_redis(data_dir)
            raise IsbServiceError(f"ISB service {service.name!r}: redis-server refused redis.native.settings.redis "
                                  f"({e}){'' if reused else '; the server it was started for is stopped'}: fix the "
                                  "setting and run 'isbflow isb up' again") from None
        finally:
            client.close()
    return ServiceUp(service.name, "redis", not reused, data_dir, redis=state, settings=settings, fsync=fsync)


def down(service: InterStepBufferService, data_dir: Path) -> ServiceDown:
    """Stop ``service``'s embedded server under ``data_dir`` by its recorded PID(s); keeps its data.
    Raises :class:`IsbServiceError` for an external service or an unreadable state file."""
    _refuse_external(service)
    if service.store == "redis":
        # lazy: redis-py (~0.3 s) is loaded for a Redis service only; ops.connection imports this module
        from isbflow.isb.redis import server

        try:
            rstate = server.stop_redis(data_dir)
        except server.EmbeddedRedisError as e:
            raise IsbServiceError(str(e)) from None
        return ServiceDown(service.name, "redis", [rstate.pid] if rstate else [])
    try:
        nstate = stop_embedded(data_dir)
    except EmbeddedNatsError as e:
        raise IsbServiceError(str(e)) from None
    return ServiceDown(service.name, "jetstream", [n.pid for n in nstate.nodes] if nstate else [])
