"""mkdocs hook: the spec and CLI reference pages are generated from the code at build time.

- ``<!-- isbflow:spec-reference -->`` becomes one table per spec model, from the pydantic
  models' ``model_json_schema()`` (field, type, default, description);
- ``<!-- isbflow:cli-reference -->`` becomes one section per ``isbflow`` command, from the
  Typer app's click commands (usage, help, options with defaults and environment variables).

So the reference cannot drift from what ``isbflow validate`` accepts and what ``isbflow --help``
prints. Nothing here fetches anything: the build stays offline.
"""

from __future__ import annotations

import json
import re

SPEC_MARK = "<!-- isbflow:spec-reference -->"
CLI_MARK = "<!-- isbflow:cli-reference -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if SPEC_MARK in markdown:
        markdown = markdown.replace(SPEC_MARK, spec_reference())
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_reference())
    if AIRFLOW_MARK in markdown:
        markdown = markdown.replace(AIRFLOW_MARK, airflow_classes())
    return markdown


# ------------------------------------------------------------------ text helpers


def _rst(text: str) -> str:
    """Docstring text for markdown: ``code`` -> `code`, :func:`x` -> `x`."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return _rst(" ".join(text.split())).replace("|", "\\|").replace("<", "&lt;")


# ------------------------------------------------------------------ the spec


def _type(schema: dict) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{schema['const']}`"
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            parts = [_type(s) for s in schema[key] if s.get("type") != "null"]
            return " or ".join(dict.fromkeys(parts)) or "null"
    kind = schema.get("type")
    if kind == "array":
        return f"list of {_type(schema.get('items', {}))}"
    if kind == "object":
        extra = schema.get("additionalProperties")
        return f"map of {_type(extra)}" if isinstance(extra, dict) else "object"
    return kind or "any"


def _default(schema: dict) -> str:
    if "default" not in schema:
        return ""
    return f"`{json.dumps(schema['default'])}`"


def _model_section(name: str, schema: dict) -> list[str]:
    lines = [f"### {name}", ""]
    if schema.get("description"):
        lines += [_rst(schema["description"]), ""]
    props = schema.get("properties")
    if not props:
        return lines
    required = set(schema.get("required", []))
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for field, prop in props.items():
        mark = f"**`{field}`**" if field in required else f"`{field}`"
        if field in required:
            mark += " (required)"
        lines.append(f"| {mark} | {_type(prop)} | {_default(prop)} | {_cell(prop.get('description', ''))} |")
    return lines + [""]


def spec_reference() -> str:
    from isbflow.spec.isbsvc import InterStepBufferService
    from isbflow.spec.models import Pipeline

    out: list[str] = []
    seen: set[str] = set()
    for kind in (Pipeline, InterStepBufferService):
        schema = kind.model_json_schema(by_alias=True)
        defs = schema.pop("$defs", {})
        out += [f"## {kind.__name__}", ""]
        out += _model_section(kind.__name__, schema)[2:]
        for name in sorted(defs):
            if name in seen:
                continue
            seen.add(name)
            out += _model_section(name, defs[name])
    return "\n".join(out)


# ------------------------------------------------------------------ the CLI


def _option_row(param, ctx) -> str:
    names = ", ".join(f"`{o}`" for o in [*param.opts, *getattr(param, "secondary_opts", [])])
    try:
        kind = str(param.display_type(ctx))
    except Exception:  # a parameter kind without a display type: leave the column empty
        kind = ""
    kind = kind.strip("<>").replace("|", "\\|")
    if getattr(param, "is_flag", False):
        kind = "flag"
    default = param.default
    empty = default is None or default is False or default == () or default == [] or callable(default)
    shown = "" if empty else f"`{default}`"
    env = param.envvar if isinstance(param.envvar, str) else ", ".join(param.envvar or [])
    help_text = getattr(param, "help", "") or ""
    if env:
        help_text += f" (environment: `{env}`)"
    if param.required:
        names += " (required)"
    return f"| {names} | {kind} | {shown} | {_cell(help_text)} |"


def _command_sections(cmd, ctx, path: list[str], out: list[str]) -> None:
    # duck-typed: Typer builds its commands on its own copy of click
    if path:
        out += [f"{'#' * min(len(path) + 1, 4)} `{' '.join(path)}`", ""]
        if cmd.help:
            out += [_rst(cmd.help.split("\f")[0]).strip(), ""]
        pieces = " ".join(cmd.collect_usage_pieces(ctx))
        out += ["```", f"{' '.join(path)} {pieces}".rstrip(), "```", ""]
        options = [p for p in cmd.params if p.param_type_name == "option" and not getattr(p, "hidden", False)]
        arguments = [p for p in cmd.params if p.param_type_name == "argument"]
        if arguments:
            out += ["Arguments: " + ", ".join(f"`{(a.name or '').upper()}`" + (f": {_cell(a.help)}" if getattr(a, "help", None) else "") for a in arguments), ""]
        if options:
            out += ["| option | type | default | description |", "|---|---|---|---|"]
            out += [_option_row(p, ctx) for p in options] + [""]
    if hasattr(cmd, "list_commands"):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            sub_ctx = sub.context_class(sub, info_name=name, parent=ctx)
            _command_sections(sub, sub_ctx, [*path, name], out)


def cli_reference() -> str:
    import typer

    from isbflow.cli import app

    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="isbflow")
    out: list[str] = []
    _command_sections(root, ctx, ["isbflow"], out)
    return "\n".join(out)


# ------------------------------------------------------------------ Airflow classes

AIRFLOW_MARK = "<!-- isbflow:airflow-classes -->"
AIRFLOW_MODULES = ("operators/isb.py", "operators/pipeline.py", "operators/replay.py", "operators/quality.py",
                   "operators/sinks.py", "operators/watchdog.py", "operators/rescale.py", "sensors/pipeline.py",
                   "sensors/lag.py",
                   "triggers/pipeline.py", "triggers/lag.py", "hooks/jetstream.py")


def airflow_classes() -> str:
    """Each public operator, sensor, trigger and hook class with its docstring, read from the source
    with ``ast`` (no Airflow import at build time)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "isbflow" / "airflow"
    out: list[str] = []
    for rel in AIRFLOW_MODULES:
        tree = ast.parse((root / rel).read_text())
        module = "isbflow.airflow." + rel.removesuffix(".py").replace("/", ".")
        for node in tree.body:
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
            if not any(b.endswith(("Operator", "Sensor", "Trigger", "Hook", "OperatorBase", "Driver", "MixIn"))
                       for b in bases):
                continue
            doc = ast.get_docstring(node) or ""
            out += [f"### {node.name}", "", f"`{module}.{node.name}`", "", _params(_rst(doc)), ""]
    return "\n".join(out)


def _params(doc: str) -> str:
    """``:param x: text`` lines as a definition-style list."""
    return re.sub(r"^:param (\w+):", r"- `\1`:", doc, flags=re.M)
