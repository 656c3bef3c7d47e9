"""A vertex's transform, ``module:function``: resolved when the spec is validated, loaded by the runner.

**Where a transform may come from** (checked by :func:`check_transform` for every udf when a
spec is loaded, so ``isbflow validate`` refuses what a step would fail on later):

1. the project's ``spark_apps`` package. The *project* of a spec file is the nearest folder
   above it holding ``spark_apps/`` (``pipelines/logs.yaml`` -> the repository), else the
   current directory: the folder launched drivers run in and import from (the launcher puts
   it on ``PYTHONPATH``);
2. the package of the project that holds the spec file itself, so a spec under
   ``tests/specs/`` may use ``tests.helpers``;
3. a package the pipeline declares in ``spec.transformPackages`` (installed in the
   environment, or a folder of the project), e.g. ``[acme_transforms]``. Python's
   standard library and isbflow itself cannot be declared.

Anything else is refused without being imported (``os:system``: ``os`` is none of these).
An allowed module is imported (with the project first on the path), and ``function`` must
be a callable taking the input DataFrame and the vertex's reference tables as keywords
(``enrich(df, services=...)``). A transform module only defines functions: importing it
must not start Spark (``spark_apps/logs.py`` imports ``pyspark.sql``, which starts nothing).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

#: the project's transforms package (``spark_apps/`` beside ``pipelines/``)
PROJECT_PACKAGE = "spark_apps"
#: what a transform is called with besides its references: the input DataFrame
_DATAFRAME = object()


class TransformError(Exception):
    """A transform entry that does not name an importable callable; the message names the entry."""


def load_transform(entry: str) -> Callable:
    """The callable ``module:function`` names (``spark_apps.logs:parse``)."""
    module, _, func = entry.partition(":")
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as e:
        raise TransformError(f"cannot load transform {entry!r}: {e}") from None


def project_root(spec_file: str | Path) -> Path:
    """The nearest folder above ``spec_file`` holding ``spark_apps/``, else the current directory."""
    here = Path(spec_file).absolute().parent
    for folder in (here, *here.parents):
        if (folder / PROJECT_PACKAGE).is_dir():
            return folder
    return Path.cwd()


def spec_package(spec_file: str | Path, root: Path) -> str | None:
    """The project's top-level package holding ``spec_file`` (``tests`` for ``tests/specs/x.yaml``)."""
    try:
        parts = Path(spec_file).absolute().relative_to(root.absolute()).parts
    except ValueError:
        return None
    if len(parts) > 1 and parts[0].isidentifier() and (root / parts[0] / "__init__.py").is_file():
        return parts[0]
    return None


def declared_package_problem(name: str) -> str | None:
    """Why ``name`` cannot be declared in ``transformPackages`` (None when it can)."""
    top = name.split(".")[0]
    if top in sys.stdlib_module_names:
        return f"{name!r} is Python's standard library, not a package of transforms"
    if top == "isbflow":
        return "isbflow's own modules are not transforms"
    return None


def allowed_packages(spec_file: str | Path, declared: Sequence[str]) -> tuple[Path, list[str]]:
    """The project of ``spec_file`` and the packages its transforms may come from."""
    root = project_root(spec_file)
    own = spec_package(spec_file, root)
    return root, list(dict.fromkeys([PROJECT_PACKAGE, *([own] if own else []), *declared]))


def check_transform(entry: str, root: Path, allowed: Sequence[str], references: Sequence[str] = ()) -> str | None:
    """Why ``entry`` is not a usable transform of a vertex with ``references`` (None when it is)."""
    module, _, func = entry.partition(":")
    if not any(module == a or module.startswith(a + ".") for a in allowed):
        return (f"module {module!r} is not a transform module isbflow may load: transforms come from the "
                f"project's {PROJECT_PACKAGE} package, the package holding the spec file, or a package listed "
                f"in the pipeline's transformPackages (allowed here: {', '.join(allowed)})")
    try:
        mod = _import(module, root)
    except ModuleNotFoundError as e:
        return f"cannot import {module!r}: no module named {e.name!r} (looked in {root} and the Python path)"
    except Exception as e:  # noqa: BLE001 - any failure of the user's module is a problem of the spec
        text = " ".join(str(e).split())[:200]
        return f"importing {module!r} failed: {type(e).__name__}: {text}"
    fn = getattr(mod, func, None)
    if fn is None:
        return f"module {module!r} has no {func!r}"
    if not callable(fn):
        return f"{entry} is a {type(fn).__name__}, not a function"
    kwargs = {r.replace("-", "_"): _DATAFRAME for r in references}
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without a signature (a builtin): nothing to check
        return None
    try:
        signature.bind(_DATAFRAME, **kwargs)
    except TypeError as e:
        call = ", ".join(["df", *(f"{k}=..." for k in kwargs)])
        return (f"{entry} cannot be called as {func}({call}) (a transform takes the DataFrame, and its "
                f"reference tables by name): {e}")
    return None


def _import(module: str, root: Path):
    """Import ``module`` with the project ``root`` first on the path (where drivers import it from)."""
    entry = os.fspath(root)
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    try:
        return importlib.import_module(module)
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)
