"""The pipelines a DAG folder knows: every spec file under the pipelines folder, loaded at parse time.

DAGs that exist once per pipeline (the watchdog's tasks, the scheduled
replays, the quality DAG's asset schedule) are generated from
:func:`load_catalog`. A spec file that does not load is kept in
``Catalog.errors`` (file -> the located spec error) instead of breaking the
DAG file: the other pipelines keep their DAGs, and the watchdog turns the
error into a failing task that names it.

At run time operators find a pipeline by name with :meth:`Catalog.find`
(asset events name pipelines, not files).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from isbflow.airflow.pipelines import pipeline_files
from isbflow.spec import SpecError, load_specs
from isbflow.spec.load import name_collisions
from isbflow.spec.models import Pipeline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CatalogEntry:
    """One pipeline and the spec file (relative to the pipelines folder) that defines it."""

    file: str
    pipeline: Pipeline

    @property
    def name(self) -> str:
        return self.pipeline.name

    @property
    def sinks(self) -> list[str]:
        return [v.name for v in self.pipeline.spec.vertices if v.sink is not None]


@dataclass
class Catalog:
    directory: Path
    entries: list[CatalogEntry] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)

    def find(self, pipeline: str) -> CatalogEntry:
        """The entry of pipeline ``pipeline``; KeyError naming the folder and what it holds."""
        for e in self.entries:
            if e.name == pipeline:
                return e
        known = ", ".join(f"{e.name} ({e.file})" for e in self.entries) or "none"
        raise KeyError(f"no spec under {self.directory} defines pipeline {pipeline!r} (pipelines: {known})")


def load_catalog(directory: str | Path) -> Catalog:
    """Every pipeline of every spec file under ``directory`` (recursively, sorted by file)."""
    cat = Catalog(Path(directory))
    seen: dict[str, str] = {}
    loaded = []
    for name in pipeline_files(cat.directory):
        try:
            specs = load_specs([cat.directory / name])
        except SpecError as e:
            cat.errors[name] = str(e)
            log.warning("spec %s does not load; its pipelines get no generated DAGs:\n%s", name, e)
            continue
        clash = [str(problem) for problem in name_collisions(*loaded, specs)]
        if clash:
            # a later file whose derived names another file already claims gets no DAGs: running
            # both would point two pipelines at one stream or bucket
            cat.errors[name] = "\n".join(clash)
            log.warning("spec %s claims derived names another spec holds; its pipelines get no "
                        "generated DAGs:\n%s", name, cat.errors[name])
            continue
        loaded.append(specs)
        for p in specs.pipelines.values():
            if p.name in seen:
                cat.errors[name] = (f"{name}: pipeline {p.name!r} is already defined in {seen[p.name]}; "
                                    "pipeline names must be unique across the pipelines folder")
                log.warning("%s", cat.errors[name])
                continue
            seen[p.name] = name
            cat.entries.append(CatalogEntry(name, p))
    return cat


def task_id_for(text: str) -> str:
    """``text`` as a task/DAG id fragment (letters, digits, ``_ - .`` only)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)
