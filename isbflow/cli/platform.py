"""``isbflow platform``: the local platform (embedded NATS + Airflow) on 127.0.0.1 (``make run``)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from isbflow import platform
from isbflow.cli.common import (
    DataDir,
    JsonOut,
    console,
    data_dir_or_default,
    err_console,
    fail,
    load_or_exit,
    print_json,
)
from isbflow.spec import Specs

app = typer.Typer(help="Run the whole platform locally: the ISB service (nats-server) and Airflow, "
                       "on 127.0.0.1 only.", no_args_is_help=True)

DEMO = platform.repo_root() / "pipelines" / "logs.yaml"


@app.command()
def up(
    port: Annotated[int, typer.Option(help="Airflow api-server (UI) port on 127.0.0.1.")] = platform.DEFAULT_API_PORT,
    nats_port: Annotated[int, typer.Option(help="NATS client port (a free one when taken).")] =
        platform.DEFAULT_NATS_PORT,
    pipeline_file: Annotated[Path | None, typer.Option(
        "--pipeline-file", help="Spec whose buffers are provisioned once Airflow is up (default: the demo).")] = None,
    provision_demo: Annotated[bool, typer.Option("--provision/--no-provision",
                                                 help="Provision the pipeline's buffers at start.")] = True,
    data_dir: DataDir = None,
) -> None:
    """Start nats-server and Airflow (api-server, scheduler, dag-processor, triggerer), stay in the foreground.

    State lives under DATA_DIR (metadata DB, admin password, buffers) and is reused by
    the next start. Ctrl-C stops every process started here.

    Example: isbflow platform up   (then open http://127.0.0.1:8080)
    """
    dd = data_dir_or_default(data_dir).resolve()
    spec = pipeline_file or DEMO
    specs = load_or_exit([spec]) if provision_demo else None
    server_settings = None
    if specs is not None and specs.pipelines:
        server_settings = specs.service_for(next(iter(specs.pipelines.values()))).spec.jetstream.settings
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the platform like Ctrl-C does
    code, state = 0, None
    try:
        with console.status("starting", spinner="dots") as spinner:
            try:  # start() stops what it started when it fails or is interrupted
                state = platform.start(dd, api_port=port, nats_port=nats_port, server_settings=server_settings,
                                       progress=spinner.update)
            except platform.PlatformError as e:
                fail(str(e))
            password = platform.admin_password(Path(state.airflow_home))
            provisioned = _provision(dd, specs, spinner.update) if specs is not None else None
            dag_seen = False
            if password:
                spinner.update("waiting for the DAGs to be parsed")
                dag_seen = platform.wait_for_dag(state, password, "isb_provision")
        _summary(state, password, spec, provisioned, dag_seen, time.monotonic() - started)
        code = _supervise(state)
    except KeyboardInterrupt:
        pass
    finally:
        if state is not None:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not leave processes behind
            err_console.print("stopping the platform ...")
            stopped = platform.stop(dd)
            if stopped is not None:
                err_console.print(f"stopped {len(stopped.processes)} Airflow process(es)"
                                  + (" and nats-server" if stopped.nats_started else ""))
    raise typer.Exit(code)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _provision(dd: Path, specs: Specs, progress) -> str:
    """Apply the pipelines' buffers on the embedded server; a one-line outcome (errors reported, not raised)."""
    from isbflow.isb import provision
    from isbflow.isb.connect import IsbUnreachable
    from isbflow.spec import SpecError

    lines = []
    for name in sorted(specs.pipelines):
        progress(f"provisioning the buffers of pipeline {name}")
        try:
            report = asyncio.run(provision.apply(platform.nats_settings(dd), specs, name))
        except (SpecError, IsbUnreachable, provision.ProvisionError) as e:
            lines.append(f"pipeline {name}: [yellow]not provisioned[/]: {e}")
            continue
        counts: dict[str, int] = {}
        for r in report.resources:
            counts[r.action.value] = counts.get(r.action.value, 0) + 1
        text = ", ".join(f"{n} {a}" for a, n in sorted(counts.items()))
        lines.append(f"pipeline {name}: {len(report.resources)} streams/buckets ({text})")
    return "\n               ".join(lines)


def _summary(state: platform.PlatformState, password: str | None, spec: Path, provisioned: str | None,
             dag_seen: bool, seconds: float) -> None:
    st = platform.status(Path(state.data_dir))
    nats = st["nats"] or {}
    nats_url = ",".join(nats.get("urls", [])) or "?"
    nats_mb = sum(nats.get("pss_mb", []))
    c = console
    c.print(f"[bold green]isbflow platform is up[/] in {seconds:.0f} s "
            f"(memory: Airflow {st['airflow_pss_mb']:.0f} MB, NATS {nats_mb:.0f} MB)")
    c.print(f"  Airflow UI   {state.url}   login: [bold]{platform.ADMIN}[/] / "
            f"[bold]{password or '(see ' + state.airflow_home + '/simple_auth_manager_passwords.json.generated)'}[/]",
            highlight=False)
    c.print(f"  NATS         {nats_url}   (user isbflow, password in {state.data_dir}/nats/password)",
            highlight=False)
    if provisioned:
        c.print(f"  buffers      {provisioned}", highlight=False)
    c.print(f"  state        {state.data_dir}  (logs: {state.airflow_home}/logs/platform/)", highlight=False)
    if not dag_seen:
        c.print("  [yellow]DAG isb_provision not parsed yet[/]: check the dag-processor log", highlight=False)
    c.print(f"First: open {state.url}, log in, open DAG [bold]isb_provision[/], click Trigger, "
            f"pick {spec.name}: the task's XCom holds the provisioning report.", highlight=False)
    c.print("Stop with Ctrl-C (or 'isbflow platform down' from another shell).")


def _supervise(state: platform.PlatformState) -> int:
    """Block until interrupted (0) or until a platform process dies (1, naming it)."""
    while True:
        dead = platform.dead_process(state)
        if dead is not None:
            err_console.print(f"airflow {dead.name} (pid {dead.pid}) exited; log {dead.log}", style="red",
                              markup=False)
            return 1
        time.sleep(1.0)


@app.command()
def status(data_dir: DataDir = None, json_out: JsonOut = False) -> None:
    """Show the platform's processes (PID, alive, resident memory) and Airflow's health.

    Exit 1 when it is not running or not healthy.
    """
    dd = data_dir_or_default(data_dir)
    st = platform.status(dd)
    if json_out:
        print_json(st)
    elif not st["processes"]:
        console.print(f"no platform recorded under {st['data_dir']}/ (start it with 'isbflow platform up')")
    else:
        t = Table("process", "pid", "alive", "memory MB (PSS)")
        for p in st["processes"]:
            t.add_row(p["name"], str(p["pid"]), "yes" if p["alive"] else "NO", f"{p['pss_mb']:.0f}")
        for n, mb in zip((st["nats"] or {}).get("nodes", []), (st["nats"] or {}).get("pss_mb", []), strict=False):
            t.add_row(f"nats-server {n['name']}", str(n["pid"]), "yes", f"{mb:.0f}")
        console.print(t)
        h = st["health"] or {}
        parts = ", ".join(f"{k} {(h.get(k) or {}).get('status', '?')}" for k in platform.HEALTH_PARTS) \
            if h else "api-server not answering"
        console.print(f"{st['url']}: {parts}", highlight=False)
    if not st["running"]:
        raise typer.Exit(1)


@app.command()
def down(data_dir: DataDir = None, json_out: JsonOut = False) -> None:
    """Stop the platform started by 'isbflow platform up' (by PID). State on disk is kept."""
    dd = data_dir_or_default(data_dir).resolve()
    state = platform.read_state(dd)
    if state is None:
        if json_out:
            print_json({"stopped": []})
        else:
            console.print(f"nothing to stop under {dd}/")
        return
    sup = state.supervisor_pid
    if sup != os.getpid() and platform.pid_alive(sup):
        os.kill(sup, signal.SIGTERM)  # the foreground 'up' stops its own processes
        deadline = time.monotonic() + 60
        while platform.pid_alive(sup) and time.monotonic() < deadline:
            time.sleep(0.3)
    try:
        platform.stop(dd)  # whatever is left (or all of it, when 'up' was killed)
    except OSError as e:
        fail(f"could not stop every process: {e}")
    pids = [p.pid for p in state.processes]
    if json_out:
        print_json({"stopped": pids, "nats_stopped": state.nats_started})
    else:
        console.print(f"stopped {len(pids)} Airflow process(es)" + (" and nats-server" if state.nats_started else ""))
