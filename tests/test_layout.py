"""The package's shape, checked: no private name crosses a module, modules fit in a head.

The layering itself is import-linter's contract in ``pyproject.toml`` (``make lint``
and ``make test`` run ``lint-imports`` before the suite); these are the rules it
cannot express.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "isbflow"

#: modules allowed over MAX_LINES, each one job (the value says why)
LONG_MODULES: dict[str, str] = {
    "isbflow.steps.runner": "one job, wiring and following a pipeline's queries (start, bookkeeping, "
                            "restart, control); its helpers live in steps/session, restart and progress",
}
MAX_LINES = 500


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse``, asked again when CPython 3.11 reports "AST constructor recursion depth
    mismatch": its AST conversion keeps one depth counter per interpreter, which another thread
    converting at the same time (a library parsing source in the background) throws off."""
    for attempt in range(5):
        try:
            return ast.parse(source, filename=filename)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == 4:
                raise
    raise AssertionError("unreachable")


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(path: Path, here: str | None = None) -> list[str]:
    """``from isbflow.x import _y`` and ``x._y`` where ``x`` is an imported isbflow module
    (``here``: the module ``path`` is, by default from its place in the package)."""
    tree = parse(path.read_text(), filename=str(path))
    here = here or _module_name(path)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found: list[str] = []
    modules: dict[str, str] = {}  # local alias -> isbflow module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("isbflow"):
            for a in node.names:
                target = f"{node.module}.{a.name}"
                if _private(a.name) and node.module != here:
                    found.append(f"{shown}:{node.lineno}: imports {target}")
                modules[a.asname or a.name] = target
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("isbflow"):
                    modules[a.asname or a.name] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in modules and modules[node.value.id] != here):
            found.append(f"{shown}:{node.lineno}: uses {modules[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_is_used_outside_its_module():
    found = [u for p in _modules() for u in private_uses(p)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_private_name_check_can_fail(tmp_path):
    bad = tmp_path / "probe.py"  # a module of isbflow.ops reaching into two others
    bad.write_text("from isbflow.steps import runner\nfrom isbflow.spec.load import _x\nrunner._apply\n")
    found = private_uses(bad, here="isbflow.ops.probe")
    assert len(found) == 2, found


def test_modules_fit_in_a_head():
    long = {_module_name(p): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES and _module_name(p) not in LONG_MODULES}
    assert not long, f"modules over {MAX_LINES} lines (split them, or justify in LONG_MODULES and the README): {long}"


def test_every_package_states_its_contract():
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = ast.get_docstring(parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(ROOT)}: no docstring stating the package's contract"


def test_no_test_module_shadows_the_standard_library():
    """A test helper run as a script (``python tests/helpers/airflow_env.py``) has its own folder
    first on ``sys.path``: a ``platform.py`` there would shadow the stdlib's for every import."""
    import sys

    shadows = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
               if p.stem in sys.stdlib_module_names]
    assert not shadows, f"test modules named like standard library modules: {shadows}"


#: where every import inside a function says why it is lazy (issue 13: imports inside functions
#: only for a heavy dependency that must stay lazy, or a cycle, each with a short reason): the whole
#: package. "isbflow/x/" is a folder, "isbflow/x/y.py" one module.
LAZY_IMPORTS_REASONED = ["isbflow/"]
#: modules in those folders exempted while being cleaned elsewhere
LAZY_IMPORTS_NOT_YET: list[str] = []


def unreasoned_imports(path: Path) -> list[str]:
    """Imports inside a function body with no ``# lazy: <why>`` comment on their first line or in the
    comment right above; a run of imports (blank lines between them aside) shares the comment above its first one."""
    lines = path.read_text().splitlines()
    found: list[str] = []
    reasoned_until = 0  # the last line of the newest import that carries a reason

    def marked(line: str) -> bool:
        return "#" in line and "lazy:" in line.split("#", 1)[1]

    def visit(node: ast.AST, in_function: bool) -> None:
        nonlocal reasoned_until
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import | ast.ImportFrom):
                first, above = lines[child.lineno - 1], child.lineno - 2
                comment = []  # the comment lines right above the import
                while above >= 0 and lines[above].strip().startswith("#"):
                    comment.append(lines[above].strip())
                    above -= 1
                if marked(first) or any(marked(c) for c in comment) or (
                        reasoned_until and not any(x.strip() for x in lines[reasoned_until:child.lineno - 1])):
                    reasoned_until = child.end_lineno or child.lineno
                else:
                    found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:"
                                 f"{child.lineno}: {first.strip()}")
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(parse("\n".join(lines), filename=str(path)), False)
    return found


def test_every_import_inside_a_function_says_why_it_is_lazy():
    """Issue 13: imports inside functions only where a heavy dependency (Spark, Airflow, GX, Delta)
    must stay lazy, each with a ``# lazy: <why>`` comment. Checked in the folders listed in
    LAZY_IMPORTS_REASONED (the whole package) but the modules in LAZY_IMPORTS_NOT_YET."""
    paths = sorted({p for entry in LAZY_IMPORTS_REASONED
                    for p in ((ROOT / entry).rglob("*.py") if entry.endswith("/") else [ROOT / entry])
                    if str(p.relative_to(ROOT)) not in LAZY_IMPORTS_NOT_YET})
    assert paths, "no module to check"
    found = [f for p in paths for f in unreasoned_imports(p)]
    assert not found, ("imports inside functions without a '# lazy: <why>' comment (move a light one to "
                       "the module's top):\n" + "\n".join(found))


def test_the_lazy_import_check_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("\n".join([
        "import json",                                       # 1: module level, never flagged
        "def f():",
        "    import os",                                     # 3: no reason
        "    # lazy: Spark's JVM starts only when asked,",
        "    # and this comment goes on",
        "    import pyspark",                                # 6: the comment above
        "    from pyspark.sql import functions  # same run",  # 7: the run's comment
        "",
        "    from isbflow import steps",                     # 9: same run, a blank line between
        "    x = 1",
        "    import sys",                                    # 11: the run ended
        "    from a import (  # lazy: on the first line",    # 12
        "        b,",
        "    )",
        "    # a comment that gives no reason",
        "    import re",                                     # 16
    ]) + "\n")
    found = unreasoned_imports(probe)
    assert [f.split(":")[1] for f in found] == ["3", "11", "16"], found


#: what ``isbflow --help`` and Airflow's parsing of the DAG files must not load (seconds each)
HEAVY = ("pyspark", "deltalake", "great_expectations")
#: the modules the DAG files in dags/ import from isbflow
DAG_FACES = ["isbflow.airflow.operators.isb", "isbflow.airflow.operators.pipeline",
             "isbflow.airflow.operators.quality", "isbflow.airflow.operators.replay",
             "isbflow.airflow.operators.sinks", "isbflow.airflow.operators.watchdog",
             "isbflow.airflow.operators.rescale",
             "isbflow.airflow.sensors.pipeline", "isbflow.airflow.triggers.pipeline",
             "isbflow.airflow.assets", "isbflow.airflow.catalog", "isbflow.airflow.pipelines"]


def heavy_modules_loaded(modules: list[str], env: dict[str, str] | None = None,
                         heavy: tuple[str, ...] = HEAVY) -> list[str]:
    """The ``heavy`` modules a fresh interpreter has loaded after importing ``modules``."""
    import subprocess
    import sys

    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"print(' '.join(m for m in {heavy!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_cli_loads_no_heavy_dependency():
    """``isbflow --help`` (every command group registers when ``isbflow.cli`` is imported) stays
    light: Spark, delta-rs and GX load only in the commands that use them."""
    assert heavy_modules_loaded(["isbflow.cli"]) == []


def test_a_driver_loads_no_client_of_a_sink_it_may_not_have():
    """A pipeline's driver imports the step runner: psycopg (~8 MiB of the driver's PSS, measured)
    loads only when a PostgreSQL sink or fallback is written, GX only for a quality run."""
    assert heavy_modules_loaded(["isbflow.ops.pipeline", "isbflow.steps.runner"],
                                heavy=("psycopg", "great_expectations")) == []


def test_the_airflow_faces_load_no_heavy_dependency(tmp_path):
    """Airflow parses the DAG files every few seconds: the isbflow modules they import load no
    heavy dependency (a pipeline's own transform modules, imported when its spec is checked, may)."""
    import os

    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path)}
    assert heavy_modules_loaded(DAG_FACES, env) == []
