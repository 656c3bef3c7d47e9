"""Load spec files and validate them once, with errors located by file and field.

``load_specs(paths)`` reads one or more YAML files (each may hold several
documents), builds the typed models and checks the rules that span fields and
documents (edges, cycles, roles, duplicate names, ISB service references).
Every problem becomes a :class:`SpecProblem`, printed as one line
``FILE: path.to.field: what is wrong (line N)``; if there is any,
:class:`SpecError` carries all of them, so a user fixes a file in one pass.
What is valid but not acted on (a ``scale.min: 0`` the step's autoscaler keeps at 1) is a
warning, located the same way, in :attr:`Specs.warnings`.

Paths are relative to the document's ``spec`` (``vertices[2].partitions``);
other top-level keys keep their name (``metadata.name``, ``kind``). The line
number points into the file, which also tells documents of one file apart.
The graph rules run on the raw document too, so a file with a field error and
a dangling edge reports both.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from isbflow.spec import derived, numaflow, transforms
from isbflow.spec.errors import SpecError, SpecProblem
from isbflow.spec.graph import check_graph
from isbflow.spec.messages import Loc, describe, field_path, shown, suggest
from isbflow.spec.models import InterStepBufferService, Pipeline
from isbflow.spec.scale import scale_warning

KINDS: dict[str, type[BaseModel]] = {
    "Pipeline": Pipeline,
    "InterStepBufferService": InterStepBufferService,
}

#: bounds that keep validation fast and small for any input (a real spec is a few KB)
MAX_SPEC_CHARS = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 100_000


@dataclass
class Specs:
    """Everything loaded: ISB services and pipelines by name, and where each came from."""

    services: dict[str, InterStepBufferService] = field(default_factory=dict)
    pipelines: dict[str, Pipeline] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # "Kind/name" -> file
    #: "Kind/name" -> its document's YAML node (for line numbers of rules checked after loading)
    nodes: dict[str, yaml.Node] = field(default_factory=dict, repr=False, compare=False)
    #: what is valid but does not do what a reader may expect (``isbflow validate`` prints each
    #: as ``warning: FILE: path: message (line N)``; the specs load all the same)
    warnings: list[SpecProblem] = field(default_factory=list)

    def service_for(self, pipeline: Pipeline) -> InterStepBufferService:
        return self.services[pipeline.spec.interStepBufferServiceName]

    def only_pipeline(self) -> Pipeline:
        if len(self.pipelines) != 1:
            raise SpecError([SpecProblem(", ".join(sorted(set(self.files.values()))), "",
                                         f"expected one Pipeline, found {len(self.pipelines)}: "
                                         "name it with --pipeline")])
        return next(iter(self.pipelines.values()))

    def select(self, pipeline: str | None = None) -> Pipeline:
        """The named pipeline, or the only one when ``pipeline`` is None (else :class:`SpecError`)."""
        if pipeline is None:
            return self.only_pipeline()
        if pipeline not in self.pipelines:
            files = ", ".join(sorted(set(self.files.values())))
            known = ", ".join(sorted(self.pipelines)) or "none"
            raise SpecError([SpecProblem(files, "", f"no Pipeline named {pipeline!r} (found: {known})")])
        return self.pipelines[pipeline]


# ------------------------------------------------------------ reading YAML


@dataclass
class _Document:
    """One YAML document of a file: its data and its node tree (for line numbers)."""

    file: str
    data: Any
    node: yaml.Node

    def problem(self, loc: Loc, message: str) -> SpecProblem:
        return SpecProblem(self.file, field_path(loc), message, _line_of(self.node, loc))


def _read_documents(path: Path, shown: str) -> tuple[list[_Document], list[SpecProblem]]:
    """The documents of one file, and duplicate-key problems. Raises SpecError if unreadable."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([SpecProblem(shown, "", "file not found")]) from None
    except UnicodeDecodeError:
        raise SpecError([SpecProblem(shown, "", "not a UTF-8 text file")]) from None
    except OSError as e:
        raise SpecError([SpecProblem(shown, "", f"cannot read: {e.strerror}")]) from None
    if len(text) > MAX_SPEC_CHARS:
        raise SpecError([SpecProblem(shown, "", f"{len(text):,} characters: a spec file may hold at most "
                                     f"{MAX_SPEC_CHARS:,} (split it into several files)")])
    docs: list[_Document] = []
    problems: list[SpecProblem] = []
    try:
        shape = _shape_problem(text)
        if shape is not None:
            message, line = shape
            raise SpecError([SpecProblem(shown, "", message, line)])
        loader = yaml.SafeLoader(text)
    except yaml.YAMLError as e:
        raise SpecError([_yaml_problem(shown, text, e)]) from None
    try:
        while loader.check_node():
            node = loader.get_node()
            doc = _Document(shown, loader.construct_document(node), node)
            problems.extend(SpecProblem(shown, field_path(loc), msg, line)
                            for loc, msg, line in _duplicate_keys(node, ()))
            if doc.data is not None:
                problems.extend(_expand_strings(doc))
                docs.append(doc)
    except yaml.YAMLError as e:
        raise SpecError([_yaml_problem(shown, text, e)]) from None
    finally:
        loader.dispose()
    return docs, problems


def _yaml_problem(shown: str, text: str, e: yaml.YAMLError) -> SpecProblem:
    """A YAML error as one located problem (a reader error names a character by position)."""
    if isinstance(e, yaml.reader.ReaderError):
        line = text.count("\n", 0, e.position) + 1
        column = e.position - (text.rfind("\n", 0, e.position) + 1) + 1
        code = ord(e.character) if isinstance(e.character, str) else int(e.character)
        what = f"character U+{code:04X}"
        return SpecProblem(shown, "", f"invalid YAML: {what} is not allowed (control characters and "
                           f"NUL are not YAML)", line, column)
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return SpecProblem(shown, "", f"invalid YAML: {problem}", mark.line + 1 if mark else None,
                       mark.column + 1 if mark else None)


def _shape_problem(text: str) -> tuple[str, int] | None:
    """(message, line) when the YAML nests deeper than :data:`MAX_DEPTH` or its aliases expand it
    beyond :data:`MAX_NODES` nodes (a "billion laughs"); None when its shape is fine.

    Walks the parser's events (an iterative state machine): no recursion and no node tree,
    so any input ends in time linear in its size.
    """
    depth, expanded = 0, 0
    weights: dict[str, int] = {}  # anchor -> nodes it stands for, aliases expanded
    stack: list[list] = []  # open collections: [anchor, nodes so far]
    for ev in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(ev, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH} levels", ev.start_mark.line + 1
            stack.append([ev.anchor, 1])
            weight = 1
        elif isinstance(ev, yaml.CollectionEndEvent):
            depth -= 1
            anchor, count = stack.pop()
            if anchor is not None:
                weights[anchor] = count
            if stack:
                stack[-1][1] += count
            continue
        elif isinstance(ev, yaml.ScalarEvent):
            weight = 1
            if ev.anchor is not None:
                weights[ev.anchor] = 1
        elif isinstance(ev, yaml.AliasEvent):
            weight = weights.get(ev.anchor, 1)
        else:
            continue
        if stack and not isinstance(ev, yaml.CollectionStartEvent):
            stack[-1][1] += weight
        expanded += weight
        if expanded > MAX_NODES:
            return (f"more than {MAX_NODES:,} values once aliases are expanded (a spec holds far fewer; "
                    "aliases that repeat aliases multiply)", ev.start_mark.line + 1)
    return None


def _expand_strings(doc: _Document) -> list[SpecProblem]:
    """Numaflow writes an ISB service's ``settings`` and ``bufferConfig`` as YAML strings
    (``bufferConfig: |`` and a block): parse each into the mapping it stands for, in place.

    The string is read like a file (same nesting, alias and duplicate-key rules); a problem
    inside it, and any field error below it later, is located at the outer field's line.
    """
    data = doc.data
    if not isinstance(data, dict) or data.get("kind") != "InterStepBufferService":
        return []
    problems = []
    for loc in numaflow.STRING_FIELDS:
        parent = data
        for part in loc[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or not isinstance(parent.get(loc[-1]), str):
            continue
        text = parent[loc[-1]]
        try:
            value, dups = _parse_string_block(text)
        except _BlockError as e:
            problems.append(doc.problem(loc, f"{loc[-1]} is a YAML string (Numaflow's form) that {e}"))
            parent[loc[-1]] = {}  # reported: validate the rest without a second problem here
            continue
        if value is None:
            value = {}  # an empty block sets nothing
        elif not isinstance(value, dict):
            problems.append(doc.problem(loc, f"{loc[-1]} as a string must hold a YAML mapping (key: value lines, "
                                             f"as Numaflow writes it), got {shown(value)}"))
            value = {}
        problems.extend(doc.problem(loc + sub, msg) for sub, msg in dups)
        parent[loc[-1]] = value
    return problems


class _BlockError(Exception):
    pass


def _parse_string_block(text: str) -> tuple[Any, list[tuple[Loc, str]]]:
    """The value a YAML string holds, and its duplicate keys (path inside it, message).
    Raises :class:`_BlockError` naming what is wrong, with the line inside the string."""
    try:
        shape = _shape_problem(text)
        if shape is not None:
            message, line = shape
            raise _BlockError(f"is {message} (line {line} of the string)")
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            value = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        where = f" (line {mark.line + 1} of the string)" if mark else ""
        raise _BlockError(f"is not valid YAML: {problem}{where}") from None
    dups = [(loc, f"{msg} (line {line} of the string)") for loc, msg, line in _duplicate_keys(node, ())] \
        if node is not None else []
    return value, dups


def _duplicate_keys(node: yaml.Node, loc: Loc) -> Iterator[tuple[Loc, str, int]]:
    """PyYAML keeps the last of two equal keys silently; a spec must not."""
    if isinstance(node, yaml.MappingNode):
        first: dict[Any, int] = {}
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            if key is not None and k.tag != "tag:yaml.org,2002:merge":
                if key in first:
                    yield (loc + (key,), f"duplicate key {key!r} (first on line {first[key]})",
                           k.start_mark.line + 1)
                else:
                    first[key] = k.start_mark.line + 1
            yield from _duplicate_keys(v, loc + (key if key is not None else "?",))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _duplicate_keys(item, loc + (i,))


def _line_of(node: yaml.Node, loc: Loc) -> int:
    """The line of the deepest node of ``loc`` that exists (a missing field: its parent)."""
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            match = next(((k, v) for k, v in node.value
                          if isinstance(k, yaml.ScalarNode) and k.value == part), None)
            if match is None:
                break
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


# ------------------------------------------------------------------ loading


def load_specs(paths: str | Path | Sequence[str | Path]) -> Specs:
    """Load and validate spec files. Raises :class:`SpecError` listing every problem."""
    if isinstance(paths, str | Path):
        paths = [paths]
    specs = Specs()
    problems: list[SpecProblem] = []
    declared: dict[str, _Document] = {}  # "Kind/name" -> first document declaring it
    pipelines: list[_Document] = []
    for p in paths:
        try:
            docs, dup_problems = _read_documents(Path(p), str(p))
        except SpecError as e:
            problems.extend(e.problems)
            continue
        problems.extend(dup_problems)
        if not docs:
            problems.append(SpecProblem(str(p), "", "no documents: expected a Pipeline or an InterStepBufferService"))
        for doc in docs:
            obj = _validate_document(doc, problems)
            data = doc.data if isinstance(doc.data, dict) else {}
            kind, name = data.get("kind"), _raw_name(data)
            if kind == "Pipeline":
                pipelines.append(doc)
            if not isinstance(kind, str) or kind not in KINDS or name is None:
                continue
            key = f"{kind}/{name}"
            if key in declared:
                first = declared[key]
                problems.append(doc.problem(("metadata", "name"), (
                    f"duplicate {kind} name {name!r} (also in {first.file} line "
                    f"{_line_of(first.node, ('metadata', 'name'))})")))
                continue
            declared[key] = doc
            if obj is None:
                continue
            if isinstance(obj, Pipeline):
                problems.extend(_transform_problems(doc, obj))
                specs.warnings.extend(_scale_warnings(doc, obj))
            specs.files[key] = doc.file
            specs.nodes[key] = doc.node
            if isinstance(obj, Pipeline):
                specs.pipelines[obj.name] = obj
            elif isinstance(obj, InterStepBufferService):
                specs.services[obj.name] = obj
    if "default" not in specs.services and not problems:
        # A pipeline that names no service gets an embedded one with defaults.
        specs.services["default"] = InterStepBufferService(kind="InterStepBufferService")
    # Services declared but invalid still count as declared: their own problems say what is wrong.
    services = {k.split("/", 1)[1] for k in declared if k.startswith("InterStepBufferService/")} | {"default"}
    for doc in pipelines:
        spec = doc.data.get("spec")
        if isinstance(spec, dict):
            problems.extend(doc.problem(("spec",) + loc, msg) for loc, msg in check_graph(spec, services))
    problems.extend(name_collisions(specs))
    if problems:
        # by file in the order given, then by line: the order a user fixes them in
        order = {f: i for i, f in reversed(list(enumerate(p.file for p in problems)))}
        raise SpecError(sorted(problems, key=lambda p: (order[p.file], p.line or 0, p.column or 0)))
    return specs


def name_collisions(*loaded: Specs) -> list[SpecProblem]:
    """Every derived stream, subject or bucket name (:mod:`isbflow.spec.derived`) that two entries
    of the pipelines in ``loaded`` claim, located at the later entry and naming the earlier one.

    :func:`load_specs` checks the files it loads together; a caller that loads files one by one
    (the Airflow catalog) passes every result here to check across them.
    """
    located: dict[str, tuple[str, yaml.Node]] = {}
    claims: list[derived.Claim] = []
    for specs in loaded:
        for name, p in specs.pipelines.items():
            key = f"Pipeline/{name}"
            if key in specs.nodes and name not in located:
                located[name] = (specs.files[key], specs.nodes[key])
                claims.extend(derived.claims(p))
    problems = []
    for c, o in derived.collisions(claims):
        file, node = located[c.pipeline]
        o_file, o_node = located[o.pipeline]
        where = f"{field_path(o.loc)} ({o.what}, line {_line_of(o_node, o.loc)})"
        if o.pipeline != c.pipeline:
            where = f"pipeline {o.pipeline}'s {where}"
        if o_file != file:
            where = f"{where} in {o_file}"
        verb = "is also derived" if c.name == o.name else f"overlaps {o.name!r}, derived"
        problems.append(SpecProblem(file, field_path(c.loc), (
            f"derived {c.kind} name {c.name!r} ({c.what}) {verb} from {where}: "
            "derived names join names with '-', so different names can give the same one; rename one "
            "of them (isbflow never changes a derived name: existing buffers keep theirs)"),
            _line_of(node, c.loc)))
    return problems


def _transform_problems(doc: _Document, p: Pipeline) -> list[SpecProblem]:
    """Each udf's transform resolved now (:mod:`isbflow.spec.transforms`), not when its step starts."""
    root, allowed = transforms.allowed_packages(doc.file, p.spec.transformPackages)
    out = []
    for i, v in enumerate(p.spec.vertices):
        if v.udf is not None:
            problem = transforms.check_transform(v.udf.transform, root, allowed, [r.name for r in v.udf.references])
            if problem:
                out.append(doc.problem(("spec", "vertices", i, "udf", "transform"), problem))
    return out


def _scale_warnings(doc: _Document, p: Pipeline) -> list[SpecProblem]:
    """A warning for each vertex whose ``scale`` asks for what the autoscaler does not do (:func:`scale_warning`)."""
    out = []
    for i, v in enumerate(p.spec.vertices):
        message = scale_warning(v.scale)
        if message:
            out.append(doc.problem(("spec", "vertices", i, "scale"), message))
    return out


def _raw_name(data: dict) -> str | None:
    meta = data.get("metadata")
    if data.get("kind") == "InterStepBufferService" and meta is None:
        return "default"
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else None


def _validate_document(doc: _Document, problems: list[SpecProblem]) -> BaseModel | None:
    """The typed model of one document, or None after adding its problems."""
    if not isinstance(doc.data, dict):
        problems.append(doc.problem((), f"expected a mapping with 'kind', got {type(doc.data).__name__}"))
        return None
    kind = doc.data.get("kind")
    model = KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        refused = numaflow.refused_kind(kind) if isinstance(kind, str) else None
        if kind is None:
            msg = f"'kind' is missing: expected one of {', '.join(KINDS)}"
        elif refused:
            msg = f"{refused} (isbflow reads {' and '.join(KINDS)})"
        else:
            msg = f"unknown kind {shown(kind)}: expected one of {', '.join(KINDS)}"
            hint = suggest(kind, list(KINDS))
            if hint:
                msg += f" (did you mean {hint!r}?)"
        problems.append(doc.problem(("kind",), msg))
        return None
    try:
        # by_name=False: the spec uses the YAML names ('from', 'schema'), never 'from_'.
        return model.model_validate(doc.data, by_alias=True, by_name=False)
    except ValidationError as e:
        for err in e.errors():
            loc, msg = describe(err, model)
            problems.append(doc.problem(loc, msg))
        return None
