"""``isbflow quality``: run a pipeline's quality gates, check its expectations, browse reports.

``run`` exits 1 when a sink with ``onFailure: fail`` fails its checks (a
``warn`` gate prints and exits 0); 2 on a bad spec or a sink that does not exist.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.table import Table

from isbflow.cli.common import (
    DataDir,
    JsonOut,
    NatsUrl,
    PipelineName,
    SpecFile,
    console,
    data_dir_or_default,
    err_console,
    fail,
    load_or_exit,
    pipeline_or_exit,
    print_json,
)

app = typer.Typer(help="Data quality of the sinks: GX suites, built-in checks, reports, gates.",
                  no_args_is_help=True)
SinkOpt = Annotated[list[str] | None, typer.Option("--sink", "-s", help="Sink vertex (repeat; default: all sinks).")]
MasterOpt = Annotated[str, typer.Option(help="Spark master, e.g. local[2].")]
WaitOpt = Annotated[float, typer.Option(
    "--wait", help="Seconds a running step gets to commit what its input buffers hold, for the committed "
                   "low watermark completeness is judged against.")]


def _sinks(p, wanted: list[str] | None) -> list[str]:
    sinks = [v.name for v in p.spec.vertices if v.sink is not None]
    for s in wanted or []:
        if s not in sinks:
            fail(f"pipeline {p.name!r} has no sink {s!r} (sinks: {', '.join(sinks)})", 2)
    return list(wanted) if wanted else sinks


@app.command("check")
def check(file: SpecFile, json_out: JsonOut = False) -> None:
    """Build every expectation of the spec with GX: exit 2 with FILE: field: problem lines if one fails."""
    # lazy: the catalog's module loads difflib and importlib.metadata, which 'isbflow --help' must not pay for
    from isbflow.spec.expectations import check_expectations

    problems = check_expectations(load_or_exit(file))
    if json_out:
        print_json({"valid": not problems, "problems": [p.__dict__ for p in problems]})
        if problems:
            raise typer.Exit(2)
        return
    if problems:
        fail("\n".join(str(p) for p in problems), 2)
    console.print("every expectation builds")


@app.command("run")
def run_cmd(file: SpecFile, sink: SinkOpt = None, pipeline: PipelineName = None, data_dir: DataDir = None,
            nats_url: NatsUrl = None, master: MasterOpt = "local[2]", wait: WaitOpt = 30.0,
            json_out: JsonOut = False) -> None:
    """Check the sinks' current Delta versions now; store a report per sink.

    Completeness is judged on the offset ledger: per source partition the sink must
    hold every offset up to the committed low watermark (what every step from the
    source to the sink has committed) and every offset the ledger records, minus dead
    letters; records past it are in flight, listed, never a failure. Windows are
    recounted once closed. Without the ISB service it falls back to the sink's own ids
    and says so. Exit 1 when a 'fail' gate fails.
    """
    # lazy: ops.quality and the quality/ modules under it add ~35 ms (-X importtime) to every command's start-up
    from isbflow.ops import quality as ops_quality
    from isbflow.ops.connection import resolve_settings
    from isbflow.ops.spark import SparkOnDemand

    specs, p = pipeline_or_exit(file, pipeline)
    names = _sinks(p, sink)
    dd = data_dir_or_default(data_dir)
    try:
        settings = resolve_settings(nats_url, dd, specs.service_for(p))
    except ops_quality.Unreachable as e:  # no embedded server state: judged without the ISB service (said below)
        err_console.print(f"[yellow]{e}[/]", highlight=False)
        settings = None
    with SparkOnDemand(master, f"isbflow-quality-{p.name}", log_level="ERROR") as spark_for:
        try:
            run = ops_quality.check_sinks(
                spark_for(), specs, p, settings, dd, names, wait_s=wait,
                on_note=lambda note: err_console.print(f"[yellow]{note}[/]", highlight=False),
                on_schema_unknown=lambda name, why: err_console.print(
                    f"sink {name}: expected schema unknown ({why}); schema check skipped"))
        except ops_quality.QualityError as e:
            fail(str(e))
        except ops_quality.Unreachable as e:
            fail(str(e))
    reports = run.reports
    if json_out:
        print_json([r.to_dict() for r in reports])
    else:
        for r in reports:
            _print_report(r.to_dict())
    if any(r.gate_failed for r in reports):
        raise typer.Exit(1)


def _print_report(r: dict) -> None:
    verdict = "passed" if r["success"] else ("FAILED" if r["gate"] == "fail" else "failed (warn gate)")
    style = "green" if r["success"] else ("red" if r["gate"] == "fail" else "yellow")
    console.print(f"[{style}]{r['pipeline']}/{r['sink']} v{r['table_version']}: {verdict}[/] "
                  f"({r['rows']} rows, run {r['run_id']})")
    for f in r["failures"]:
        console.print(f"  {f['name']}: {f['unexpected_count']} unexpected, e.g. {f['samples'][:3]}",
                      markup=False, highlight=False)
    for c in r["checks"]:
        for line in _check_lines(c):
            console.print(f"  {line}", markup=False, highlight=False)
    if r.get("pruned"):
        console.print(f"  pruned {len(r['pruned'])} old report(s): {', '.join(r['pruned'])}")


def _check_lines(c: dict) -> list[str]:
    """What a check says beyond pass/fail: why it was skipped, the proven ranges and what is in flight,
    the pending windows."""
    if c.get("skipped"):
        return [f"{c['name']}: skipped ({c['skipped']})"]
    d = c.get("details") or {}
    if c["name"] == "completeness" and d.get("basis") == "ledger":
        lines = []
        for part, v in d.get("partitions", {}).items():
            proven = ", ".join(f"{a}..{b}" for a, b in v["proven"]) or "nothing"
            gone = "dead-lettered or in the sink's fallback" if d.get("in_fallback") else "dead-lettered"
            dead = f", {v['dead_lettered']} of them {gone}" if v.get("dead_lettered") else ""
            line = f"completeness {part}: proven {proven} ({v['watermark_from']}{dead})"
            fly = v["in_flight"]
            if fly["count"]:
                age = "" if fly["oldest_age_s"] is None else f", the oldest {fly['oldest_age_s']:.0f}s old"
                line += f"; {fly['count']} in flight from {part}/{fly['oldest']}{age}"
            lines.append(line)
        return lines
    if c["name"] == "completeness" and d.get("basis_note"):
        return [f"completeness: sink basis ({d['basis_note']})"]
    if c["name"] == "windows" and d.get("pending"):
        return [f"windows: {d.get('checked', 0)} of {d.get('closed', 0)} closed window(s) recounted; "
                f"{d['pending']} pending ({d.get('open', 0)} open, {d.get('waiting_for_raw', 0)} waiting for raw "
                f"records in flight); watermark {d.get('watermark')} ({d.get('watermark_from')})"]
    return []


@app.command("verify")
def verify_cmd(file: SpecFile, sink: SinkOpt = None, pipeline: PipelineName = None, data_dir: DataDir = None,
               json_out: JsonOut = False) -> None:
    """Prove from each sink's Delta table alone (no ISB service) which source ranges it holds completely
    and exactly once.

    The claim is what isbflow's commits recorded (their isb.offsets); the proof fails, naming
    the ranges, on offsets claimed but not held (rows deleted), held but never claimed, held
    twice, and on any commit made outside isbflow. Sinks without _isb_id are not verified.
    Exit 1 when a sink fails, 2 on a bad spec or sink.
    """
    # lazy: ops.quality and the quality/ modules under it add ~35 ms (-X importtime) to every command's start-up
    from isbflow.ops.quality import verify_sinks

    _, p = pipeline_or_exit(file, pipeline)
    results = verify_sinks(p, data_dir_or_default(data_dir), _sinks(p, sink))
    if json_out:
        print_json([r.to_json() for r in results])
    else:
        for r in results:
            v = r.verification
            if v is None:
                console.print(f"{r.sink}: not verified ({r.skipped})", markup=False, highlight=False)
                continue
            proven = "; ".join(f"{part} " + ", ".join(f"{a}..{b}" for a, b in rs[:5])
                               + (f" and {len(rs) - 5} more" if len(rs) > 5 else "")
                               for part, rs in v.proven.items()) or "nothing"
            verdict = "[green]proven[/]" if v.ok else "[red]FAILED[/]"
            console.print(f"{r.sink}: {verdict} (table v{v.version}, {v.rows} rows, {v.commits} commits)")
            console.print(f"  held completely and exactly once: {proven}", markup=False, highlight=False)
            for line in v.problems():
                console.print(f"  {line}", markup=False, highlight=False)
    code = 1 if any(not r.ok for r in results) else 0
    sys.stdout.flush()
    raise typer.Exit(code)


@app.command("reports")
def reports_cmd(file: SpecFile, sink: SinkOpt = None, pipeline: PipelineName = None, data_dir: DataDir = None,
                limit: Annotated[int, typer.Option(help="At most this many runs.")] = 20,
                json_out: JsonOut = False) -> None:
    """The history of quality runs, newest first."""
    # lazy: ops.quality and the quality/ modules under it add ~35 ms (-X importtime) to every command's start-up
    from isbflow.ops.quality import list_reports

    _, p = pipeline_or_exit(file, pipeline)
    dd = data_dir_or_default(data_dir)
    found = [r for s in _sinks(p, sink) for r in list_reports(dd, p.name, s)]
    found.sort(key=lambda r: str(r.get("run_id")), reverse=True)
    found = found[:limit]
    if json_out:
        print_json(found)
        return
    table = Table("time", "sink", "version", "result", "failed checks", "run id", "docs")
    for r in found:
        result = "error" if "error" in r else "pass" if r.get("success") else f"FAIL ({r.get('gate')})"
        shadow = r.get("shadow") if isinstance(r.get("shadow"), dict) else None
        sink = str(r.get("sink")) + (f" (shadow {shadow.get('run')})" if shadow else "")
        table.add_row(str(r.get("time", "")), sink, str(r.get("table_version", "")), result,
                      ", ".join(f"{f['name']}={f['unexpected_count']}" for f in r.get("failures", [])),
                      str(r.get("run_id")), str(r.get("docs") or ""))
    console.print(table)
