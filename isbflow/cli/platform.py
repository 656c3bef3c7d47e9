"""``isbflow platform``: the whole local platform on 127.0.0.1 (``make run``).

``up`` starts the embedded nats-server, the demo pipeline (provisioned, reference
tables put, its steps launched detached; a spec whose ISB service is ``redis.native``
runs on its redis-server, started too), a producer feeding it and Airflow, then
stays in the foreground; Ctrl-C (or ``down`` from another shell) drains the
pipeline and stops every process it started. A second ``up`` reuses what runs.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

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

if TYPE_CHECKING:
    from isbflow import platform

app = typer.Typer(help="Run the whole platform locally: the ISB service (nats-server), the demo pipeline with a "
                       "producer, and Airflow, on 127.0.0.1 only.", no_args_is_help=True)

#: the defaults of 'platform up', as isbflow.platform has them (tests/cli/test_startup.py checks they
#: agree): importing isbflow.platform here would load the NATS client and the launcher for every command
DEFAULT_API_PORT = 8080
DEFAULT_NATS_PORT = 4222
DEFAULT_RATE = 100.0
#: where the plugin's pages live under the api-server
PIPELINES_PAGE = "/isbflow/pipelines"


@app.command()
def up(
    port: Annotated[int, typer.Option(help="Airflow api-server (UI) port on 127.0.0.1.")] = DEFAULT_API_PORT,
    nats_port: Annotated[int, typer.Option(help="NATS client port (a free one when taken).")] =
        DEFAULT_NATS_PORT,
    pipeline_file: Annotated[Path | None, typer.Option(
        "--pipeline-file", "-f", help="The pipeline to run (default: the demo, pipelines/logs.yaml). A spec whose "
                                      "ISB service is redis.native (pipelines/logs-redis.yaml) runs on its own "
                                      "redis-server, started under DATA_DIR/redis (a live one is reused).")] = None,
    run_pipeline: Annotated[bool, typer.Option(
        "--pipeline/--no-pipeline", help="Provision and start the pipeline and its producer.")] = True,
    rate: Annotated[float, typer.Option(
        min=0, help="Events per second the producer publishes to the pipeline's source (0: no producer). "
                    "Its events carry event times from the moment it starts, 10 ms apart: at 100/s they keep "
                    "pace with the clock.")] =
        DEFAULT_RATE,
    master: Annotated[str, typer.Option(help="Spark master of the pipeline's driver.")] = "local[2]",
    processing_time: Annotated[str | None, typer.Option(
        help="The trigger interval of the source steps, e.g. '4 seconds': the latency budget; a longer one "
             "costs less CPU per event (the steps after the source are event-driven: they start when their "
             "input grows). Default: the spec's limits.readTimeout, 5 seconds when unset.")] = None,
    data_dir: DataDir = None,
) -> None:
    """Start nats-server, the pipeline with a producer (and its spec's redis-server when its buffers are
    in Redis), and Airflow; stay in the foreground.

    State lives under DATA_DIR (metadata DB, admin password, buffers, checkpoints, sinks)
    and is reused by the next start. Ctrl-C drains the pipeline, then stops every process
    started here. Run while the platform runs, it reuses it (no second pipeline or producer).

    Example: isbflow platform up   (then open http://127.0.0.1:8080)

    Example: isbflow platform up -f pipelines/logs-redis.yaml   (the demo on Redis buffers)
    """
    # lazy: the platform and ops.pipeline load the NATS client and the launcher; 'isbflow --help' must not
    from isbflow import platform
    from isbflow.ops import pipeline as ops_pipeline

    dd = data_dir_or_default(data_dir).resolve()
    spec = (pipeline_file or platform.demo_spec()).resolve()
    server_settings, opts = None, None
    if run_pipeline:
        if processing_time is not None:
            try:
                ops_pipeline.check_processing_time(processing_time)
            except ops_pipeline.LaunchError as e:
                fail(f"--processing-time: {e}", 2)
        specs = load_or_exit([spec])
        if len(specs.pipelines) != 1:
            fail(f"{spec}: holds {len(specs.pipelines)} pipelines; the platform runs exactly one", 2)
        service = specs.service_for(next(iter(specs.pipelines.values())))
        if service.store == "redis" and service.spec.redis.native is None:
            fail(f"{spec}: ISB service {service.name!r} is redis.external: the platform runs a pipeline on "
                 "Redis with the redis-server it starts (redis.native)", 2)
        server_settings = service.spec.jetstream.settings  # the nats-server's (it runs for Airflow either way)
        opts = platform.PipelineOptions(str(spec), rate=rate, master=master, processing_time=processing_time)
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM ('isbflow platform down') stops it like Ctrl-C
    code, state, owner = 0, None, False
    try:
        with console.status("starting", spinner="dots") as spinner:
            try:  # up() stops what it started when it fails or is interrupted
                state, report, reused = platform.up(dd, api_port=port, nats_port=nats_port,
                                                    server_settings=server_settings, pipeline=opts,
                                                    progress=spinner.update)
            except platform.PlatformError as e:
                fail(str(e))
            owner = not reused or not state.supervised()
            if reused and owner:
                platform.adopt(state)  # its supervisor is gone: this process stops it on Ctrl-C
            check = report.check if report else None
            if report is not None and report.restarts:
                err_console.print(f"a step failed while the pipeline started; its driver was restarted "
                                  f"{report.restarts} time(s)", style="yellow")
        _summary(state, report, check, reused, time.monotonic() - started)
        if not owner:
            console.print(f"Already supervised by pid {state.supervisor_pid} (its terminal's Ctrl-C or "
                          "'isbflow platform down' stops it).", highlight=False)
            return
        console.print("Stop with Ctrl-C (drains the pipeline, then stops every process) or "
                      "'isbflow platform down' from another shell.")
        code = _supervise(state)
    except KeyboardInterrupt:
        pass
    finally:
        if state is not None and owner:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not leave processes behind
            _stop(dd)
    raise typer.Exit(code)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _stop(dd: Path) -> None:
    # lazy: the platform loads the NATS client and the launcher, which 'isbflow --help' must not pay for
    from isbflow import platform

    err_console.print("stopping the platform (draining the pipeline first) ...")
    with err_console.status("stopping", spinner="dots") as spinner:
        stopped = platform.stop(dd, progress=spinner.update)
    if stopped is None:
        return
    for key, outcome in stopped.drained.items():
        err_console.print(f"pipeline {key}: {outcome}", markup=False, highlight=False)
    s = stopped.state
    err_console.print(_stopped(s, len(stopped.leftovers)), highlight=False)


def _stopped(state: platform.PlatformState, leftovers: int = 0) -> str:
    """'stopped N Airflow process group(s), the producer, ... and nats-server': what stopping ``state`` ended."""
    what = [f"{len(state.processes)} Airflow process group(s)", *(["the producer"] if state.producer else []),
            *([f"{leftovers} leftover process(es)"] if leftovers else []),
            *(["nats-server"] if state.nats_started else []), *(["redis-server"] if state.redis_started else [])]
    return "stopped " + (", ".join(what[:-1]) + " and " + what[-1] if len(what) > 1 else what[0])


def _summary(state: platform.PlatformState, report: platform.PipelineReport | None,
             check, reused: bool, seconds: float) -> None:
    # lazy: the platform loads the NATS client and the launcher, which 'isbflow --help' must not pay for
    from isbflow import platform

    st = platform.status(Path(state.data_dir))
    nats = st["nats"] or {}
    nats_url = ",".join(nats.get("urls", [])) or "?"
    c = console
    head = "isbflow platform already runs" if reused else f"isbflow platform is up in {seconds:.0f} s"
    c.print(f"[bold green]{head}[/] (memory: Airflow {st['airflow_pss_mb']:.0f} MB, "
            f"NATS {sum(nats.get('pss_mb', [])):.0f} MB{_driver_memory(report)})")
    # the password is pointed at, never printed (terminal scrollback and CI logs keep what is printed)
    c.print(f"  Airflow UI   {state.url}   login: [bold]{platform.ADMIN}[/], password in "
            f"{Path(state.airflow_home) / platform.PASSWORD_FILE} (owner-only)", highlight=False)
    if report is not None:
        rec = report.launch
        steps = ", ".join(f"{v} {s}" for v, s in check.steps.items()) if check else "?"
        c.print(f"  pipeline     {report.pipeline} ({rec.spec}): {steps}", highlight=False)
        if check is not None and not check.done:
            c.print(f"               [yellow]not every step runs yet[/]: {check.problem or 'still starting'}",
                    highlight=False)
        c.print(f"               driver pid {rec.pid} ({'already running' if rec.reused else 'launched'}), "
                f"log {rec.log}", highlight=False)
        c.print(f"               buffers: {report.provisioned}", highlight=False)
        for name, n in report.references.items():
            c.print(f"               reference table {name}: {n['written']} written, {n['unchanged']} unchanged "
                    f"(revision {n['revision']})", highlight=False)
        if report.producer is not None:
            what = "already running" if report.producer_reused else f"from event {report.producer_start:,}"
            rate = state.pipeline.rate if state.pipeline else 0
            c.print(f"  producer     {rate:g} events/s into the source ({what}), pid {report.producer.pid}, "
                    f"log {report.producer.log}", highlight=False)
    c.print(f"  NATS         {nats_url}   (user isbflow, password in {state.data_dir}/nats/password)",
            highlight=False)
    redis = st.get("redis")
    if redis:
        how = "started" if redis["started_by_platform"] else "already running"
        c.print(f"  Redis        {redis['url']}   pid {redis['pid']} ({how}), the pipeline's buffers (user "
                f"{redis['user']}, password in {redis['password_file']}; log {redis['log']})", highlight=False)
    c.print(f"  state        {state.data_dir}  (Airflow logs: {state.airflow_home}/logs/platform/, "
            f"drivers: {state.data_dir}/logs/)", highlight=False)
    c.print(f"First: open {state.url}, log in as {platform.ADMIN}, then open [bold]{state.url}{PIPELINES_PAGE}[/] "
            "(Browse > Pipelines): every step running with its rates. Then trigger DAG [bold]pipeline_quality[/] "
            "(it also runs by itself after every drain, batch run and replay) and open Browse > Quality for its "
            "report.",
            highlight=False)


def _driver_memory(report: platform.PipelineReport | None) -> str:
    # lazy: the platform loads the NATS client and the launcher, which 'isbflow --help' must not pay for
    from isbflow import platform

    if report is None or report.launch.alive() is not True:
        return ""
    return f", pipeline driver {platform.group_memory(report.launch.pid) / 2**20:.0f} MB"


def _supervise(state: platform.PlatformState) -> int:
    """Block until interrupted (0) or until an Airflow process dies (1, naming it); warn once when
    the producer exits (it ends after its count)."""
    # lazy: the platform loads the NATS client and the launcher, which 'isbflow --help' must not pay for
    from isbflow import platform

    warned = False
    while True:
        dead = platform.dead_process(state)
        if dead is not None:
            err_console.print(f"airflow {dead.name} (pid {dead.pid}) exited; log {dead.log}", style="red",
                              markup=False)
            return 1
        current = platform.read_state(Path(state.data_dir))
        producer = current.producer if current else None
        if producer is not None and not producer.alive() and not warned:
            err_console.print(f"the producer (pid {producer.pid}) has exited; log {producer.log}", style="yellow",
                              markup=False)
            warned = True
        time.sleep(2.0)


@app.command()
def status(data_dir: DataDir = None, json_out: JsonOut = False) -> None:
    """Show the platform's processes (PID, alive, CPU over half a second, memory), Airflow's health, the pipeline's steps
    (state, rates, lag) and the producer.

    Exit 1 when it is not running or not healthy.
    """
    # lazy: the platform loads the NATS client and the launcher, which 'isbflow --help' must not pay for
    from isbflow import platform

    dd = data_dir_or_default(data_dir)
    st = platform.status(dd)
    if json_out:
        print_json(st)
    elif not st["processes"]:
        console.print(f"no platform recorded under {st['data_dir']}/ (start it with 'isbflow platform up')")
    else:
        _print_status(st)
    if not st["running"]:
        raise typer.Exit(1)


def _print_status(st: dict) -> None:
    # lazy: the platform loads the NATS client and the launcher, which 'isbflow --help' must not pay for
    from isbflow import platform

    t = Table("process", "pid", "alive", "CPU % (1 core = 100)", "memory MB (PSS)")

    def row(name: str, p: dict, alive: str) -> None:
        live = "cpu_pct" in p
        t.add_row(name, str(p["pid"]), alive, f"{p['cpu_pct']:.0f}" if live else "",
                  f"{p['pss_mb']:.0f}" if live and "pss_mb" in p else "")

    for p in st["processes"]:
        row(f"airflow {p['name']}", p, "yes" if p["alive"] else "NO")
    nats = st["nats"] or {}
    for n, mb, cpu in zip(nats.get("nodes", []), nats.get("pss_mb", []), nats.get("cpu_pct", []), strict=False):
        row(f"nats-server {n['name']}", {"pid": n["pid"], "pss_mb": mb, "cpu_pct": cpu}, "yes")
    redis = st.get("redis")
    if redis:
        row(f"redis-server {redis['url']}", redis, "yes" if redis["alive"] else "NO")
    prod = st.get("producer")
    if prod:
        row(f"producer ({prod['rate']:g}/s)", prod, "yes" if prod["alive"] else "no (exited)")
    pipe = st.get("pipeline") or {}
    launch = pipe.get("launch")
    if launch:
        row(f"pipeline {pipe.get('name')} driver", launch, "yes" if launch["alive"] else "no")
    console.print(t)
    h = st["health"] or {}
    parts = ", ".join(f"{k} {(h.get(k) or {}).get('status', '?')}" for k in platform.HEALTH_PARTS) \
        if h else "api-server not answering"
    console.print(f"{st['url']}: {parts}" + ("" if st.get("supervised") else " (no supervisor: stop it with "
                                              "'isbflow platform down')"), highlight=False)
    if redis:
        console.print(f"redis-server {redis['url']}: the pipeline's buffers (user {redis['user']}, password in "
                      f"{redis['password_file']})", highlight=False)
    if pipe:
        if pipe.get("error"):
            console.print(f"pipeline {pipe.get('name', '?')}: {pipe['error']}", style="yellow", markup=False)
        steps = Table("step", "state", "batch", "in rows/s", "done rows/s", "rows", "lag", "heartbeat",
                      title=f"pipeline {pipe.get('name')} (source holds {pipe.get('source_messages')} messages)")
        for v, s in (pipe.get("steps") or {}).items():
            if s is None:
                steps.add_row(v, "never reported", "", "", "", "", "", "")
                continue
            steps.add_row(v, s["state"], str(s["batch_id"]), f"{s['input_rows_per_s']:,.0f}",
                          f"{s['processed_rows_per_s']:,.0f}", f"{s['rows_total']:,}", str(s["lag"]),
                          f"{s['heartbeat_age_s']:.0f}s ago")
        console.print(steps)


@app.command()
def down(
    data_dir: DataDir = None,
    json_out: JsonOut = False,
    timeout: Annotated[float, typer.Option(help="Seconds the pipeline's drain may take before its driver "
                                                "is stopped by PID.")] = 180.0,
) -> None:
    """Stop the platform started by 'isbflow platform up': drain the pipeline, then stop every process
    (by PID). State on disk is kept."""
    # lazy: the platform loads the NATS client and the launcher, which 'isbflow --help' must not pay for
    from isbflow import platform

    dd = data_dir_or_default(data_dir).resolve()
    state = platform.read_state(dd)
    if state is None:
        if json_out:
            print_json({"stopped": [], "drained": {}})
        else:
            console.print(f"nothing to stop under {dd}/")
        return
    report = None
    if state.supervised():
        sup = state.supervisor_pid
        if not json_out:
            console.print(f"asking the platform's 'up' (pid {sup}) to drain and stop ...")
        os.kill(sup, signal.SIGTERM)  # the foreground 'up' drains and stops its own processes
        deadline = time.monotonic() + timeout + 120
        while platform.pid_alive(sup) and time.monotonic() < deadline:
            time.sleep(0.3)
    try:
        with err_console.status("stopping", spinner="dots") as spinner:
            report = platform.stop(dd, drain_timeout=timeout, progress=spinner.update)  # whatever is left
    except (OSError, platform.PlatformError) as e:
        fail(f"could not stop every process: {e}")
    pids = [p.pid for p in state.processes]
    drained = report.drained if report else {}
    if json_out:
        print_json({"stopped": pids, "producer": state.producer.pid if state.producer else None,
                    "drained": drained, "leftovers": report.leftovers if report else [],
                    "nats_stopped": state.nats_started, "redis_stopped": state.redis_started})
        return
    for key, outcome in drained.items():
        console.print(f"pipeline {key}: {outcome}", markup=False, highlight=False)
    console.print(_stopped(state), highlight=False)
