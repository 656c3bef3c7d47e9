"""Load spec files and validate them once, with errors located by file and field.

``load_specs(paths)`` reads one or more YAML files (each may hold several
documents), builds the typed models and checks the rules that span documents
(edges, cycles, names, ISB service references). Every problem becomes a
:class:`SpecProblem` ``FILE: path.to.field: what is wrong``; if there is any,
:class:`SpecError` carries all of them, so a user fixes a file in one pass.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from isbflow.spec.models import InterStepBufferService, Pipeline

KINDS: dict[str, type[BaseModel]] = {
    "Pipeline": Pipeline,
    "InterStepBufferService": InterStepBufferService,
}


@dataclass(frozen=True)
class SpecProblem:
    file: str
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.path}: {self.message}" if self.path else f"{self.file}: {self.message}"


class SpecError(Exception):
    """One or more problems in spec files; ``str()`` is one line per problem."""

    def __init__(self, problems: Sequence[SpecProblem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


@dataclass
class Specs:
    """Everything loaded: ISB services and pipelines by name, and where each came from."""

    services: dict[str, InterStepBufferService] = field(default_factory=dict)
    pipelines: dict[str, Pipeline] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # "Kind/name" -> file

    def service_for(self, pipeline: Pipeline) -> InterStepBufferService:
        return self.services[pipeline.spec.interStepBufferServiceName]

    def only_pipeline(self) -> Pipeline:
        if len(self.pipelines) != 1:
            raise SpecError([SpecProblem(", ".join(sorted(set(self.files.values()))), "",
                                         f"expected one Pipeline, found {len(self.pipelines)}: "
                                         "name it with --pipeline")])
        return next(iter(self.pipelines.values()))


def _loc_to_path(loc: Iterable[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _describe(err: dict[str, Any], model: type[BaseModel]) -> tuple[str, str]:
    loc = list(err["loc"])
    # pydantic puts the failing union/validator function name into loc for some
    # error types; drop tokens that are not field names ("function-after[...]").
    loc = [p for p in loc if not (isinstance(p, str) and ("[" in p or p.startswith("function")))]
    if loc and loc[0] == "spec":
        loc = loc[1:]
    kind = err["type"]
    msg = err["msg"]
    if kind == "extra_forbidden":
        name = str(loc[-1]) if loc else "?"
        msg = f"unknown field {name!r}"
        known = _known_fields(model, list(err["loc"])[:-1])
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            msg += f" (did you mean {close[0]!r}?)"
        elif known:
            msg += f" (allowed: {', '.join(sorted(known))})"
    elif kind == "missing":
        msg = "required field is missing"
    elif kind == "value_error":
        msg = msg.removeprefix("Value error, ")
    elif kind == "literal_error" or kind == "enum":
        msg = f"{msg}, got {err.get('input')!r}"
    elif kind.endswith("_type") or kind.endswith("_parsing"):
        msg = f"{msg.lower()}, got {err.get('input')!r}"
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        ctx = err.get("ctx", {})
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=",
              "less_than": "<"}[kind]
        bound = next(iter(ctx.values()), "?")
        msg = f"must be {op} {bound}, got {err.get('input')!r}"
    return _loc_to_path(loc), msg


def _known_fields(model: type[BaseModel], loc: list[Any]) -> list[str]:
    """Field names (by alias) allowed at ``loc`` inside ``model``, for suggestions."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        f = next((f for n, f in current.model_fields.items() if (f.alias or n) == part), None)
        if f is None:
            return []
        current = _model_of(f.annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [f.alias or n for n, f in current.model_fields.items()]
    return []


def _model_of(annotation: Any) -> Any:
    from typing import get_args

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _read_documents(path: Path, shown: str) -> list[Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError([SpecProblem(shown, "", "file not found")]) from None
    except OSError as e:
        raise SpecError([SpecProblem(shown, "", f"cannot read: {e.strerror}")]) from None
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise SpecError([SpecProblem(shown, where, f"invalid YAML: {problem}")]) from None


def load_specs(paths: str | Path | Sequence[str | Path]) -> Specs:
    """Load and validate spec files. Raises :class:`SpecError` listing every problem."""
    if isinstance(paths, str | Path):
        paths = [paths]
    specs = Specs()
    problems: list[SpecProblem] = []
    origin: dict[str, tuple[str, str]] = {}  # "Kind/name" -> (file, doc prefix)
    for p in paths:
        shown = str(p)
        try:
            docs = _read_documents(Path(p), shown)
        except SpecError as e:
            problems.extend(e.problems)
            continue
        if not docs:
            problems.append(SpecProblem(shown, "", "no documents: expected a Pipeline or an InterStepBufferService"))
        for i, doc in enumerate(docs):
            prefix = f"[document {i + 1}] " if len(docs) > 1 else ""
            if not isinstance(doc, dict):
                problems.append(SpecProblem(shown, "", f"{prefix}expected a mapping with 'kind', got {type(doc).__name__}"))
                continue
            kind = doc.get("kind")
            model = KINDS.get(kind) if isinstance(kind, str) else None
            if model is None:
                problems.append(SpecProblem(shown, "kind", f"{prefix}unknown kind {kind!r}: expected one of {', '.join(KINDS)}"))
                continue
            try:
                obj = model.model_validate(doc)
            except ValidationError as e:
                for err in e.errors():
                    path, msg = _describe(err, model)
                    problems.append(SpecProblem(shown, prefix + path, msg))
                continue
            key = f"{kind}/{obj.metadata.name}"
            if key in origin:
                problems.append(SpecProblem(shown, prefix + "metadata.name",
                                            f"duplicate {kind} name {obj.metadata.name!r} (also in {origin[key][0]})"))
                continue
            origin[key] = (shown, prefix)
            specs.files[key] = shown
            if isinstance(obj, Pipeline):
                specs.pipelines[obj.name] = obj
            else:
                specs.services[obj.name] = obj
    if "default" not in specs.services and not problems:
        # A pipeline that names no service gets an embedded one with defaults.
        specs.services["default"] = InterStepBufferService(kind="InterStepBufferService")
    for pipeline in specs.pipelines.values():
        file, prefix = origin[f"Pipeline/{pipeline.name}"]
        problems.extend(SpecProblem(file, prefix + path, msg) for path, msg in check_pipeline(pipeline, specs))
    if problems:
        raise SpecError(problems)
    return specs


def check_pipeline(pipeline: Pipeline, specs: Specs) -> list[tuple[str, str]]:
    """Rules across fields of one pipeline: names, edges, cycles, roles, references."""
    out: list[tuple[str, str]] = []
    spec = pipeline.spec
    if spec.interStepBufferServiceName not in specs.services:
        known = ", ".join(sorted(specs.services)) or "none"
        out.append(("interStepBufferServiceName",
                    f"unknown InterStepBufferService {spec.interStepBufferServiceName!r} (declared: {known})"))
    seen: dict[str, int] = {}
    for i, v in enumerate(spec.vertices):
        if v.name in seen:
            out.append((f"vertices[{i}].name", f"duplicate vertex name {v.name!r} (also vertices[{seen[v.name]}])"))
        else:
            seen[v.name] = i
    if not any(v.source for v in spec.vertices):
        out.append(("vertices", "a pipeline needs at least one source vertex"))
    if not any(v.sink for v in spec.vertices):
        out.append(("vertices", "a pipeline needs at least one sink vertex"))
    edge_keys: set[tuple[str, str]] = set()
    for i, e in enumerate(spec.edges):
        for end, attr in ((e.from_, "from"), (e.to, "to")):
            if end not in seen:
                close = difflib.get_close_matches(end, list(seen), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                out.append((f"edges[{i}].{attr}", f"no vertex named {end!r}{hint}"))
        if e.from_ in seen and spec.vertices[seen[e.from_]].sink:
            out.append((f"edges[{i}].from", f"{e.from_!r} is a sink: a sink has no outputs"))
        if e.to in seen and spec.vertices[seen[e.to]].source:
            out.append((f"edges[{i}].to", f"{e.to!r} is a source: a source has no inputs"))
        if e.from_ == e.to:
            out.append((f"edges[{i}]", f"edge from {e.from_!r} to itself"))
        if (e.from_, e.to) in edge_keys:
            out.append((f"edges[{i}]", f"duplicate edge {e.from_!r} -> {e.to!r}"))
        edge_keys.add((e.from_, e.to))
    for name, i in seen.items():
        v = spec.vertices[i]
        if v.role != "source" and not any(e.to == name for e in spec.edges):
            out.append((f"vertices[{i}]", f"{name!r} has no input edge"))
        if v.role != "sink" and not any(e.from_ == name for e in spec.edges):
            out.append((f"vertices[{i}]", f"{name!r} has no output edge"))
    cycle = _find_cycle([(e.from_, e.to) for e in spec.edges if e.from_ in seen and e.to in seen])
    if cycle:
        out.append(("edges", "cycle: " + " -> ".join(cycle)))
    sinks = {v.name for v in spec.vertices if v.sink}
    for i, q in enumerate(spec.quality):
        if q.sink not in sinks:
            out.append((f"quality[{i}].sink", f"no sink vertex named {q.sink!r} (sinks: {', '.join(sorted(sinks))})"))
    return out


def _find_cycle(edges: list[tuple[str, str]]) -> list[str] | None:
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in graph.get(n, []):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if state.get(m) is None:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in list(graph):
        if state.get(n) is None:
            found = visit(n)
            if found:
                return found
    return None
