"""``isbflow quality``: run a pipeline's quality gates, check its expectations, browse reports.

``run`` exits 1 when a sink with ``onFailure: fail`` fails its checks (a
``warn`` gate prints and exits 0); 2 on a bad spec or a sink that does not exist.
"""

from __future__ import annotations

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
    settings_or_exit,
)

app = typer.Typer(help="Data quality of the sinks: GX suites, built-in checks, reports, gates.",
                  no_args_is_help=True)
SinkOpt = Annotated[list[str] | None, typer.Option("--sink", "-s", help="Sink vertex (repeat; default: all sinks).")]
MasterOpt = Annotated[str, typer.Option(help="Spark master, e.g. local[2].")]


def _sinks(p, wanted: list[str] | None) -> list[str]:
    sinks = [v.name for v in p.spec.vertices if v.sink is not None]
    for s in wanted or []:
        if s not in sinks:
            fail(f"pipeline {p.name!r} has no sink {s!r} (sinks: {', '.join(sinks)})", 2)
    return list(wanted) if wanted else sinks


@app.command("check")
def check(file: SpecFile, json_out: JsonOut = False) -> None:
    """Build every expectation of the spec with GX: exit 2 with FILE: field: problem lines if one fails."""
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
            nats_url: NatsUrl = None, master: MasterOpt = "local[2]", json_out: JsonOut = False) -> None:
    """Check the sinks' current Delta versions now; store a report per sink.

    Needs the ISB service (dead letters for completeness, reference tables for
    the expected schema). Exit 1 when a 'fail' gate fails.
    """
    from isbflow.ops import quality as ops_quality  # imports Spark: only this command needs it
    from isbflow.ops.spark import SparkOnDemand

    specs, p = pipeline_or_exit(file, pipeline)
    names = _sinks(p, sink)
    settings = settings_or_exit(nats_url, data_dir, specs, p.name)
    dd = data_dir_or_default(data_dir)
    with SparkOnDemand(master, f"isbflow-quality-{p.name}", log_level="ERROR") as spark_for:
        try:
            reports = ops_quality.check_sinks(
                spark_for(), specs, p, settings, dd, names,
                on_schema_unknown=lambda name, why: err_console.print(
                    f"sink {name}: expected schema unknown ({why}); schema check skipped")).reports
        except ops_quality.QualityError as e:
            fail(str(e))
        except ops_quality.Unreachable as e:
            fail(str(e))
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
        if c.get("skipped"):
            console.print(f"  {c['name']}: skipped ({c['skipped']})", markup=False, highlight=False)
    if r.get("pruned"):
        console.print(f"  pruned {len(r['pruned'])} old report(s): {', '.join(r['pruned'])}")


@app.command("reports")
def reports_cmd(file: SpecFile, sink: SinkOpt = None, pipeline: PipelineName = None, data_dir: DataDir = None,
                limit: Annotated[int, typer.Option(help="At most this many runs.")] = 20,
                json_out: JsonOut = False) -> None:
    """The history of quality runs, newest first."""
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
        table.add_row(str(r.get("time", "")), str(r.get("sink")), str(r.get("table_version", "")), result,
                      ", ".join(f"{f['name']}={f['unexpected_count']}" for f in r.get("failures", [])),
                      str(r.get("run_id")), str(r.get("docs") or ""))
    console.print(table)
