"""The embedded nats-server's config file, one per node (:func:`node_config`).

Logs rotate at :data:`LOG_SIZE_LIMIT`, keeping :data:`LOGS_KEPT` files; users come from an
included ``auth.conf`` (rewritten and reloaded by :func:`isbflow.isb.server.grant_pipelines`);
with a cipher the JetStream store is encrypted at rest (:mod:`isbflow.isb.encryption`: the key
is read from the environment, never written here).
"""

from __future__ import annotations

from pathlib import Path

from isbflow.isb import encryption

HOST = "127.0.0.1"
#: the ``authorization`` block the node configs include (users and their permissions)
AUTH_FILE = "auth.conf"
#: a node's log is rotated at this size (nats-server's ``logfile_size_limit``) ...
LOG_SIZE_LIMIT = "10MB"
#: ... and this many files are kept, the current one included (``logfile_max_num``)
LOGS_KEPT = 5


def node_config(node: str, client: int, http: int, cluster: int | None, routes: list[int], store: Path,
                user: str | None, route_password: str | None, max_payload: int,
                max_mem: int, max_file: int, tls: dict | None, log: Path | None = None,
                cipher: str = encryption.PLAIN) -> str:
    """The config of node ``node``: listeners on :data:`HOST`, JetStream under ``store`` with these
    limits (encrypted with ``cipher`` unless :data:`~isbflow.isb.encryption.PLAIN`), the users file
    when ``user`` is set, TLS with ``tls`` files, and routes to the other nodes' ``routes`` ports."""
    lines = [
        f"server_name: {node}",
        *([f'logfile: "{log}"', f"logfile_size_limit: {LOG_SIZE_LIMIT}", f"logfile_max_num: {LOGS_KEPT}"]
          if log is not None else []),
        f"listen: {HOST}:{client}",
        f"http: {HOST}:{http}",
        f"max_payload: {max_payload}",
        "max_pending: 256MB",
        f'jetstream {{ store_dir: "{store}", max_memory_store: {max_mem}, max_file_store: {max_file}'
        f"{encryption.config_line(cipher)} }}",
    ]
    if user:  # the users, rewritten by grant_pipelines and reloaded without a restart
        lines.append(f'include "{AUTH_FILE}"')
    if tls:
        lines.append(
            f'tls {{ cert_file: "{tls["cert"]}", key_file: "{tls["key"]}", ca_file: "{tls["ca"]}", timeout: 5 }}'
        )
    if cluster is not None:
        # Routes have their own secret: a client's credentials do not let anyone join the cluster.
        cred = f"route:{route_password}@" if user else ""
        rts = ", ".join(f'"nats-route://{cred}{HOST}:{p}"' for p in routes)
        auth = f'authorization {{ user: "route", password: "{route_password}", timeout: 5 }}' if user else ""
        lines.append(f"cluster {{\n  name: isbflow\n  listen: {HOST}:{cluster}\n  routes: [{rts}]\n  {auth}\n}}")
    return "\n".join(lines) + "\n"
