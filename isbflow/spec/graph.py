"""The pipeline graph, walked in one place: reachability, topological order, cycles, and the rules
that span a pipeline's vertices and edges (checked on the raw document, so a file with a field
error and a dangling edge reports both).

Every walk is iterative: a spec of any size (within the loader's bounds) is checked without
recursion.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from isbflow.spec.names import NAME_PATTERN, VERTEX_ROLES

Loc = tuple[str | int, ...]


def reach(start: str, step: Callable[[str], Iterable[str]]) -> set[str]:
    """Every node reachable from ``start`` by ``step`` (not ``start`` itself, unless on a cycle)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for n in step(todo.pop()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def topological_order(nodes: list[str], edges: list[tuple[str, str]]) -> list[str]:
    """``nodes``, each after all its inputs (Kahn's algorithm, stable in the given order)."""
    out_edges: dict[str, list[str]] = {n: [] for n in nodes}
    indeg = dict.fromkeys(nodes, 0)
    for a, b in edges:
        out_edges.setdefault(a, []).append(b)
        indeg[b] = indeg.get(b, 0) + 1
    order: list[str] = []
    ready = [n for n in nodes if indeg[n] == 0]
    while ready:
        n = ready.pop(0)
        order.append(n)
        for m in out_edges.get(n, []):
            indeg[m] -= 1
            if indeg[m] == 0:
                ready.append(m)
    return order


def check_graph(spec: dict[str, Any], services: set[str]) -> list[tuple[Loc, str]]:
    """Rules across fields of one pipeline's ``spec``: ISB service reference,
    vertex names, roles against edges, dangling edges and vertices, cycles,
    quality sinks, edges of ``udf.output: update`` steps.

    Works on the raw mapping, so it also runs when some fields failed their
    own validation; what is malformed here is skipped (its field error says
    why) rather than reported twice.
    """
    out: list[tuple[Loc, str]] = []
    isb = spec.get("interStepBufferServiceName", "default")
    if isinstance(isb, str) and isb not in services:
        out.append((("interStepBufferServiceName",),
                    f"unknown InterStepBufferService {isb!r} (declared: {', '.join(sorted(services))})"))
    raw_vertices = spec.get("vertices")
    raw_vertices = raw_vertices if isinstance(raw_vertices, list) else []
    seen: dict[str, int] = {}
    roles: dict[str, str | None] = {}  # None: not exactly one role (a field error says so)
    complete = True  # every vertex has a usable name and role
    for i, v in enumerate(raw_vertices):
        name = v.get("name") if isinstance(v, dict) else None
        if not isinstance(name, str):
            complete = False
            continue
        if name in seen:
            out.append((("vertices", i, "name"), f"duplicate vertex name {name!r} (also vertices[{seen[name]}])"))
            continue
        seen[name] = i
        present = [r for r in VERTEX_ROLES if v.get(r) is not None]
        roles[name] = present[0] if len(present) == 1 else None
        complete = complete and roles[name] is not None
    if complete and isinstance(spec.get("vertices"), list):
        if "source" not in roles.values():
            out.append((("vertices",), "a pipeline needs at least one source vertex"))
        if "sink" not in roles.values():
            out.append((("vertices",), "a pipeline needs at least one sink vertex"))
    raw_edges = spec.get("edges", [])
    raw_edges = raw_edges if isinstance(raw_edges, list) else []
    edges: list[tuple[str, str]] = []
    resolved = complete
    vertices_known = isinstance(spec.get("vertices"), list)  # else its field error says why
    for i, e in enumerate(raw_edges):
        a, b = (e.get("from"), e.get("to")) if isinstance(e, dict) else (None, None)
        if not (isinstance(a, str) and isinstance(b, str)):
            resolved = False
            continue
        for end, attr in ((a, "from"), (b, "to")):
            if end not in seen and vertices_known:
                resolved = False
                close = difflib.get_close_matches(end, list(seen), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                out.append((("edges", i, attr), f"no vertex named {end!r}{hint}"))
        if roles.get(a) == "sink":
            out.append((("edges", i, "from"), f"{a!r} is a sink: a sink has no outputs"))
            continue
        if roles.get(b) == "source":
            out.append((("edges", i, "to"), f"{b!r} is a source: a source has no inputs"))
            continue
        if a == b:
            out.append((("edges", i), f"edge from {a!r} to itself"))
        elif (a, b) in edges:
            out.append((("edges", i), f"duplicate edge {a!r} -> {b!r}"))
        edges.append((a, b))
    if resolved:  # a dangling vertex is only worth a line when every edge was understood
        for name, i in seen.items():
            lacks = []
            if roles[name] != "source" and not any(b == name for _, b in edges):
                lacks.append("input")
            if roles[name] != "sink" and not any(a == name for a, _ in edges):
                lacks.append("output")
            if lacks:
                out.append((("vertices", i), f"{name!r} has no {' and no '.join(lacks)} edge: "
                                             "connect it in 'edges' or remove it"))
    cycle = find_cycle([(a, b) for a, b in edges if a in seen and b in seen and a != b])
    if cycle:
        out.append((("edges",), "cycle: " + " -> ".join(cycle)))
    out.extend(_update_output_rules(raw_vertices, raw_edges, roles))
    out.extend(_condition_rules(raw_vertices, raw_edges, roles))
    raw_quality = spec.get("quality", [])
    if complete and isinstance(raw_quality, list):
        sinks = sorted(n for n, r in roles.items() if r == "sink")
        # a vertex with an invalid name has its own error; a quality entry naming it is not a second one
        names_valid = all(re.match(NAME_PATTERN, n) for n in roles)
        first_entry: dict[str, int] = {}
        for i, q in enumerate(raw_quality):
            sink = q.get("sink") if isinstance(q, dict) else None
            if isinstance(sink, str) and sink not in sinks and names_valid:
                out.append((("quality", i, "sink"),
                            f"no sink vertex named {sink!r} (sinks: {', '.join(sinks) or 'none'})"))
            elif isinstance(sink, str) and sink in first_entry:
                out.append((("quality", i, "sink"),
                            f"sink {sink!r} already has a quality entry (quality[{first_entry[sink]}]): "
                            "merge them into one"))
            elif isinstance(sink, str):
                first_entry[sink] = i
    return out


def _update_output_rules(raw_vertices: list, raw_edges: list,
                         roles: dict[str, str | None]) -> list[tuple[Loc, str]]:
    """Edges of a step with ``udf.output: update`` (rows that change: an aggregate's windows).

    Such rows only make sense to a sink that upserts them on the step's keys:
    each edge must end in a sink, that sink may have no other input, and a
    ``partitionKey`` must be one of the keys (every version of a key must land
    in one edge partition, so the sink sees them in order).
    """
    keys: dict[str, list[str]] = {}
    for v in raw_vertices:
        udf = v.get("udf") if isinstance(v, dict) else None
        if isinstance(udf, dict) and udf.get("output") == "update" and isinstance(v.get("name"), str):
            k = udf.get("keys")
            keys[v["name"]] = [x for x in k if isinstance(x, str)] if isinstance(k, list) else []
    if not keys:
        return []
    out: list[tuple[Loc, str]] = []
    inputs: dict[str, list[str]] = {}
    for e in raw_edges:
        if isinstance(e, dict) and isinstance(e.get("from"), str) and isinstance(e.get("to"), str):
            inputs.setdefault(e["to"], []).append(e["from"])
    for i, e in enumerate(raw_edges):
        if not isinstance(e, dict) or e.get("from") not in keys or not isinstance(e.get("to"), str):
            continue
        a, b = e["from"], e["to"]
        if roles.get(b) not in (None, "sink"):
            out.append((("edges", i, "to"), f"{b!r} is a {roles[b]}: {a!r} has output 'update' (rows that "
                                            "change, e.g. open windows) and can feed only sinks, which "
                                            "upsert them on its keys"))
            continue
        others = [x for x in inputs.get(b, []) if x != a]
        if roles.get(b) == "sink" and others:
            out.append((("edges", i, "to"), f"sink {b!r} upserts the rows of {a!r} (output 'update') and "
                                            f"cannot take other inputs too (also fed by {', '.join(others)})"))
        pk = e.get("partitionKey")
        if isinstance(pk, str) and keys[a] and pk not in keys[a]:
            out.append((("edges", i, "partitionKey"), f"{pk!r} is not one of the keys of {a!r} "
                                                      f"({', '.join(keys[a])}): every version of a key must "
                                                      "go to one partition"))
    return out


def _condition_rules(raw_vertices: list, raw_edges: list,
                     roles: dict[str, str | None]) -> list[tuple[Loc, str]]:
    """Conditional forwarding (``edges[].conditions``, ``vertices[].onUnrouted``).

    Only a udf's transform sets a record's ``_tags``, so an edge with conditions
    must leave a udf; ``onUnrouted`` says what happens to a record no out edge
    takes, so it is refused on a vertex where that cannot happen (no out edge
    with conditions).
    """
    out: list[tuple[Loc, str]] = []
    conditional: set[str] = set()
    for i, e in enumerate(raw_edges):
        if not isinstance(e, dict) or e.get("conditions") is None or not isinstance(e.get("from"), str):
            continue
        a = e["from"]
        conditional.add(a)
        if roles.get(a) == "source":
            out.append((("edges", i, "conditions"),
                        f"{a!r} is a source: it cannot tag records (only a udf's transform sets the "
                        "_tags column conditions match); put the conditions on an edge leaving a udf"))
    for i, v in enumerate(raw_vertices):
        if isinstance(v, dict) and "onUnrouted" in v and isinstance(v.get("name"), str) \
                and v["name"] not in conditional:
            out.append((("vertices", i, "onUnrouted"),
                        f"has no effect: no out edge of {v['name']!r} has conditions, so every record "
                        "is taken; remove it, or add conditions.tags to its out edges"))
    return out


def find_cycle(edges: list[tuple[str, str]]) -> list[str] | None:
    """A cycle of the graph as ``[a, b, ..., a]``, or None; iterative (any number of vertices)."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in list(graph):
        if root in state:
            continue
        path: list[str] = [root]
        todo: list[Iterator[str]] = [iter(graph.get(root, []))]
        state[root] = 1
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                todo.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                todo.append(iter(graph.get(nxt, [])))
    return None
