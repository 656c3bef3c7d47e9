"""``JetStreamHook``: the ISB service (NATS JetStream) as an Airflow connection.

Connection type ``nats``, default connection id ``nats_default``. The hook turns
the connection into :class:`isbflow.isb.connect.NatsSettings`; every isbflow
operator, sensor and trigger talks to NATS through those settings, so DAG files
carry no credentials.

Connection fields:

- ``host`` + ``port``: one server (``127.0.0.1`` / ``4222``). ``host`` may also
  hold a comma-separated list of servers or URLs (``n1:4222,n2:4222`` or
  ``nats://n1:4222,tls://n2:4222``), or extra ``servers`` may (list or comma
  string); extra ``servers`` wins.
- ``login`` + ``password``: user and password; extra ``token``: a token.
- extra ``creds_file`` (NATS ``.creds``), ``tls_ca``, ``tls_cert``, ``tls_key``,
  ``tls_insecure`` (bool).

In URI form: ``AIRFLOW_CONN_NATS_DEFAULT='nats://user:pass@127.0.0.1:4222'``;
in JSON form: ``{"conn_type": "nats", "host": "127.0.0.1", "port": 4222,
"login": "isbflow", "password": "...", "extra": {"tls_ca": "/path/ca.pem"}}``.

**Fallback.** When the connection is not defined at all, the hook does what the
``isbflow`` command does (:func:`isbflow.isb.connect.resolve_settings`):
``NATS_URL`` if set, else the spec's ``jetstream.url`` when it is not
``embedded``, else the embedded server recorded under ``ISBFLOW_HOME`` (or the
``data_dir`` given to the hook; default ``./.isbflow``). So a laptop started with
``isbflow platform up`` or ``isbflow nats up`` works without any connection.

Passwords and tokens never reach the logs: the hook logs ``NatsSettings.display``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException

from isbflow.ops.connection import NatsSettings, connect, default_data_dir, resolve_settings

if TYPE_CHECKING:
    import nats.aio.client

    from isbflow.spec.models import InterStepBufferService

DEFAULT_PORT = 4222
_TRUE = {"1", "true", "yes", "on"}


class JetStreamHook(BaseHook):
    """Settings and clients for the ISB service behind an Airflow ``nats`` connection.

    :param nats_conn_id: the Airflow connection id (default ``nats_default``).
    :param data_dir: where the embedded server's state is looked up when the
        connection does not exist (default ``ISBFLOW_HOME`` or ``./.isbflow``).
    """

    conn_name_attr = "nats_conn_id"
    default_conn_name = "nats_default"
    conn_type = "nats"
    hook_name = "NATS JetStream (isbflow ISB service)"

    def __init__(self, nats_conn_id: str = default_conn_name, data_dir: str | Path | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.nats_conn_id = nats_conn_id
        self.data_dir = data_dir

    def get_settings(self, service: InterStepBufferService | None = None) -> NatsSettings:
        """The settings of the connection, or the fallback (module docstring) when it is undefined.

        ``service`` (the pipeline's ISB service spec) is used by the fallback only.
        """
        try:
            conn = self.get_connection(self.nats_conn_id)
        except AirflowNotFoundException:
            conn = None
        return self._settings(conn, service)

    async def aget_settings(self, service: InterStepBufferService | None = None) -> NatsSettings:
        """:meth:`get_settings` for coroutines (triggers): the connection is read without blocking."""
        try:
            conn = await self.aget_connection(self.nats_conn_id)
        except AirflowNotFoundException:
            conn = None
        return self._settings(conn, service)

    def _settings(self, conn: Any, service: InterStepBufferService | None) -> NatsSettings:
        if service is not None and service.store == "redis":  # the connection is the JetStream service's
            settings = resolve_settings(data_dir=self.data_dir, service=service)
            self.log.info("ISB service %r keeps its buffers in Redis at %s", service.name, settings.display)
            return settings
        if conn is None:
            settings = resolve_settings(data_dir=self.data_dir, service=service)
            self.log.info("connection %r is not defined; using %s (NATS_URL, spec or embedded server)",
                          self.nats_conn_id, settings.display)
            return settings
        settings = settings_from_connection(conn)
        self.log.info("connection %r: ISB service at %s", self.nats_conn_id, settings.display)
        return settings

    def get_conn(self) -> NatsSettings:
        """The :class:`NatsSettings` (clients are async: use :meth:`aconnect` in a coroutine)."""
        return self.get_settings()

    async def aconnect(self, service: InterStepBufferService | None = None) -> nats.aio.client.Client:
        """A connected nats-py client; raises :class:`isbflow.isb.connect.IsbUnreachable`."""
        return await connect(self.get_settings(service), name=f"isbflow-airflow-{self.nats_conn_id}")

    def test_connection(self) -> tuple[bool, str]:
        """Connect and ask JetStream for its account info (the UI's *Test* button)."""

        async def probe() -> str:
            nc = await self.aconnect()
            try:
                info = await nc.jetstream().account_info()
                return f"JetStream reachable: {info.streams} stream(s)"
            finally:
                await nc.close()

        try:
            return True, asyncio.run(probe())
        except Exception as e:  # the UI shows the message; IsbUnreachable words it for the user
            return False, str(e)


#: the connection of readers (the UI): the ISB service's read-only ``reader`` user
READER_CONN_ID = "nats_reader"


def reader_settings(data_dir: str | Path | None = None,
                    service: InterStepBufferService | None = None) -> NatsSettings:
    """Settings for what only reads (the UI): the ``nats_reader`` connection (the platform defines it
    with the embedded server's ``reader`` user), else the default connection and its fallback; for a
    Redis service, its native redis-server's ``reader`` ACL user (the admin's settings when isbflow
    provisioned no pipeline there yet, or the server is external)."""
    if service is not None and service.store == "redis":
        # lazy: ops.isb loads the provisioning code; only a Redis service needs it here
        from isbflow.ops.isb import READER, role_settings

        settings = resolve_settings(data_dir=data_dir, service=service)
        return role_settings(settings, Path(data_dir) if data_dir is not None else default_data_dir(), READER)
    hook = JetStreamHook(READER_CONN_ID, data_dir=data_dir)
    try:
        conn = hook.get_connection(READER_CONN_ID)
    except AirflowNotFoundException:
        return JetStreamHook(data_dir=data_dir).get_settings(service)
    return hook._settings(conn, service)


def settings_from_connection(conn: Any) -> NatsSettings:
    """Build settings from an Airflow connection's fields (see the module docstring)."""
    extra = conn.extra_dejson or {}
    raw = extra.get("servers") or conn.host or ""
    items = raw if isinstance(raw, list | tuple) else str(raw).split(",")
    servers = tuple(_server_url(str(s).strip(), conn.port) for s in items if str(s).strip())
    if not servers:
        raise ValueError(
            f"Airflow connection {conn.conn_id!r} names no NATS server: set its host "
            "(e.g. 127.0.0.1, or a comma list of nats:// URLs) or extra 'servers'"
        )
    return NatsSettings(
        servers=servers,
        user=conn.login or None,
        password=conn.password or None,
        token=extra.get("token") or None,
        creds_file=extra.get("creds_file") or None,
        tls_ca=extra.get("tls_ca") or None,
        tls_cert=extra.get("tls_cert") or None,
        tls_key=extra.get("tls_key") or None,
        tls_insecure=str(extra.get("tls_insecure", "")).lower() in _TRUE,
    )


def _server_url(item: str, port: int | None) -> str:
    if "://" in item:
        return item
    if ":" in item.rsplit("]", 1)[-1]:  # host:port (IPv6 in brackets allowed)
        return f"nats://{item}"
    return f"nats://{item}:{port or DEFAULT_PORT}"
