"""Conditional forwarding (Numaflow's ``conditions.tags``) on a real nats-server and a real SparkSession.

One udf tags each record with the tags of its event; three sinks hang off it with
``or``, ``and`` and ``not`` conditions, chosen so that some records match none of
them. The expected contents are computed in Python with sets (Numaflow's rules),
independently of the Spark expressions the runner builds.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from deltalake import DeltaTable
from typer.testing import CliRunner

from isbflow.isb import provision
from isbflow.isb.connect import connect
from isbflow.isb.dlq import read_dead_letters
from isbflow.spec import load_specs
from isbflow.steps.runner import PipelineRunner, StepError

# the tags of record n are TAGS[n % len(TAGS)] ("" = no tags)
TAGS = ["", "a", "b", "c", "a,b", "a,c", "a,d", "b,c", "a,b,c", "d"]
COUNT = 50
#: sink -> (operator, values) of the edge tag -> sink; 'any' is tag's first out edge
EDGES = {"any": ("or", ["b", "c"]), "both": ("and", ["a", "b"]), "none": ("not", ["a"])}

SPEC = """\
apiVersion: isbflow.io/v1alpha1
kind: InterStepBufferService
metadata:
  name: default
spec:
  jetstream:
    url: embedded
    bufferConfig:
      stream:
        maxBytes: 16MiB
---
apiVersion: isbflow.io/v1alpha1
kind: Pipeline
metadata:
  name: route
spec:
  transformPackages: [tests.helpers]
  vertices:
    - name: in
      source:
        jetstream:
          subject: route.events
        schema: "n INT, tags STRING"
    - name: tag
      {on_unrouted}udf:
        transform: tests.helpers.routing_transforms:{transform}
    - name: any
      partitions: 2
      sink:
        delta:
          path: sinks/any
    - name: both
      sink:
        delta:
          path: sinks/both
    - name: none
      sink:
        delta:
          path: sinks/none
  edges:
    - from: in
      to: tag
{edges}"""


def spec_text(transform: str = "tag", on_unrouted: str | None = None) -> str:
    edges = ""
    for sink, (op, values) in EDGES.items():
        edges += (f"    - from: tag\n      to: {sink}\n" + ("      partitionKey: n\n" if sink == "any" else "")
                  + f"      conditions:\n        tags:\n          operator: {op}\n"
                  f"          values: [{', '.join(values)}]\n")
    return SPEC.format(transform=transform, edges=edges,
                       on_unrouted=f"onUnrouted: {on_unrouted}\n      " if on_unrouted else "")


def takes(op: str, values: list[str], tags: set[str]) -> bool:
    """Numaflow's rule, on sets."""
    if op == "or":
        return bool(tags & set(values))
    if op == "and":
        return set(values) <= tags
    return not tags & set(values)


def tags_of(n: int) -> set[str]:
    return {t for t in TAGS[n % len(TAGS)].split(",") if t}


def expected() -> tuple[dict[str, set[int]], set[int]]:
    per_sink = {s: {n for n in range(COUNT) if takes(op, vs, tags_of(n))} for s, (op, vs) in EDGES.items()}
    unrouted = set(range(COUNT)) - set().union(*per_sink.values())
    return per_sink, unrouted


def setup(nats_server, tmp_path, **kw):
    path = tmp_path / "route.yaml"
    path.write_text(spec_text(**kw))
    specs = load_specs(path)
    p = specs.only_pipeline()
    asyncio.run(provision.apply(nats_server.settings, specs))
    return path, specs, p


async def _publish(settings, count: int, start: int = 0) -> None:
    nc = await connect(settings)
    try:
        js = nc.jetstream()
        for n in range(start, start + count):
            event = {"n": n, "tags": TAGS[n % len(TAGS)]}
            await js.publish("route.events", json.dumps(event).encode(), headers={"Nats-Msg-Id": f"route-{n}"})
    finally:
        await nc.close()


def run(spark, specs, p, settings, data_dir):
    runner = PipelineRunner(spark, specs, p, settings, data_dir)
    try:
        return runner.run_available_now()
    finally:
        runner.close()


def sink_rows(data_dir, sink: str) -> tuple[list[int], list[str]]:
    table = DeltaTable(str(data_dir / "sinks" / sink)).to_pyarrow_table()
    return table.column("n").to_pylist(), table.column_names


def ledger_lows(settings, p) -> tuple[dict[str, int], dict[str, int]]:
    """Per sink, the first offset its own ledger entry lacks, and the first its entry with the
    offsets routed away from it lacks (the source stream holds record n at sequence n + 1)."""
    from isbflow.isb import ledger
    from isbflow.isb.routed import read_covered

    async def go():
        nc = await connect(settings)
        try:
            return await ledger.read(nc, p.name), await read_covered(nc, p.name)
        finally:
            await nc.close()

    own, covered = asyncio.run(go())
    return tuple({s: ledger.low_offsets({s: held.get(s, {})}, ["in/0"])["in/0"].low for s in EDGES}
                 for held in (own, covered))


def test_the_rules_of_the_fixture_leave_records_unrouted():
    """The scenario exercises every case: each sink gets some records, some get none, one gets two."""
    per_sink, unrouted = expected()
    assert all(per_sink.values()) and unrouted
    assert per_sink["any"] & per_sink["both"]  # a record may go to several edges


def test_tags_route_records_and_unrouted_ones_are_dropped_and_counted(spark, nats_server, tmp_path):
    path, specs, p = setup(nats_server, tmp_path)
    settings = nats_server.settings
    asyncio.run(_publish(settings, COUNT))
    out = run(spark, specs, p, settings, tmp_path)
    per_sink, unrouted = expected()
    for sink, want in per_sink.items():
        got, columns = sink_rows(tmp_path, sink)
        assert sorted(got) == sorted(want), sink  # each once, exactly the matching ones
        # routing metadata never reaches a sink
        assert "_tags" not in columns and "_isb_unrouted" not in columns and "tags" in columns, columns
    assert out["tag"].unrouted_total == len(unrouted)
    assert out["tag"].dlq_total == 0 and asyncio.run(read_dead_letters(settings, p.name, "tag")) == []
    assert out["in"].unrouted_total == 0
    # each sink's edge is its gate: the offsets it did not take are in the ledger as routed away, so
    # every sink's ledger covers every record (recovery would not replay from each sink's first hole)
    own, covered = ledger_lows(settings, p)
    assert covered == dict.fromkeys(EDGES, COUNT + 1)
    assert own == {s: min(n for n in range(COUNT) if n not in want) + 1 for s, want in per_sink.items()}

    # the count is in the step's heartbeat: `pipeline status --json` shows it
    from isbflow.cli import app

    r = CliRunner().invoke(app, ["pipeline", "status", "-f", str(path), "--data-dir", str(tmp_path),
                                 "--nats-url", nats_server.url, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["steps"]["tag"]["unrouted_total"] == len(unrouted)

    # a second run adds the new records' count to the running total (kept with the write stats)
    asyncio.run(_publish(settings, COUNT, start=COUNT))
    again = run(spark, specs, p, settings, tmp_path)
    more = {n for n in range(COUNT, 2 * COUNT) if not any(takes(op, vs, tags_of(n)) for op, vs in EDGES.values())}
    assert again["tag"].unrouted_total == len(unrouted) + len(more)
    assert ledger_lows(settings, p)[1] == dict.fromkeys(EDGES, 2 * COUNT + 1)


def test_unrouted_records_go_to_the_dead_letter_buffer_when_asked(spark, nats_server, tmp_path):
    _, specs, p = setup(nats_server, tmp_path, on_unrouted="deadLetter")
    settings = nats_server.settings
    asyncio.run(_publish(settings, COUNT))
    out = run(spark, specs, p, settings, tmp_path)
    per_sink, unrouted = expected()
    for sink, want in per_sink.items():
        assert sorted(sink_rows(tmp_path, sink)[0]) == sorted(want), sink
    letters = asyncio.run(read_dead_letters(settings, p.name, "tag"))
    assert sorted(dl["record"]["n"] for dl in letters) == sorted(unrouted)
    for dl in letters:
        tags = TAGS[dl["record"]["n"] % len(TAGS)].replace(",", ", ")
        assert dl["reason"] == f"no out edge's conditions match tags [{tags}] at step tag", dl
        assert dl["step"] == "tag" and dl["origin"] == dl["record"]["_isb_id"]
        assert not {"_tags", "_isb_unrouted", "_isb_error"} & set(dl["record"]), dl["record"]
    assert out["tag"].unrouted_total == out["tag"].dlq_total == len(unrouted)


@pytest.mark.parametrize("transform,words", [
    ("untagged", ["out edges to any, both, none have conditions.tags", "no _tags column"]),
    ("tagged_as_string", ["must be array<string>", "got string"]),
])
def test_a_step_with_conditional_edges_must_return_tags(spark, nats_server, tmp_path, transform, words):
    _, specs, p = setup(nats_server, tmp_path, transform=transform)
    runner = PipelineRunner(spark, specs, p, nats_server.settings, tmp_path)
    try:
        with pytest.raises(StepError) as e:
            runner.run_available_now(only=["tag"])
    finally:
        runner.close()
    assert all(w in str(e.value) for w in words), str(e.value)
    assert "step 'tag'" in str(e.value)
