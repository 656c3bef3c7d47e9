"""One GX Core validation of a Spark DataFrame in a file context, with its Data Docs page.

The file context lives under ``<data dir>/quality/gx`` (GX's own layout in
``gx/``). Per sink there is one Spark data source asset, one suite, one
validation definition and one checkpoint named ``<pipeline>.<sink>``; each run
replaces the suite with the current expectations (the spec is the source of
truth, not GX's stored suite) and runs the checkpoint with an
``UpdateDataDocsAction``. GX pieces used: ``gx.get_context(mode="file")``,
``context.data_sources.add_or_update_spark``, ``add_dataframe_asset``,
``add_batch_definition_whole_dataframe``, ``gx.ExpectationSuite``,
``gx.ValidationDefinition``, ``gx.Checkpoint`` + ``UpdateDataDocsAction``,
``Checkpoint.run(batch_parameters={"dataframe": df}, run_id=RunIdentifier)``,
``context.get_docs_sites_urls(resource_identifier=...)``.

The report keeps its own copy of the page (:mod:`isbflow.quality.docs`), so the
GX copy and GX's stored validation result are removed after the run: GX's
folders do not grow with the run history. Runs on one data dir are serialised
with a file lock (GX rewrites ``great_expectations.yml``).
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from isbflow.quality.checks import SAMPLE_SIZE, CheckResult
from isbflow.spec.expectations import build_expectation

log = logging.getLogger(__name__)

DATASOURCE = "isbflow"
_META_KEY = "isbflow_check"


@dataclass(frozen=True)
class ExpectationRun:
    """One expectation to run: its report name, GX name, arguments and origin."""

    name: str
    expectation: str
    kwargs: dict[str, Any]
    origin: str = "spec"


@dataclass
class GxOutcome:
    results: list[CheckResult]
    docs_html: str | None  # the Data Docs page as GX rendered it (CDN links still in)
    gx_run_id: str


def gx_root(data_dir: Path) -> Path:
    return Path(data_dir) / "quality" / "gx"


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".isbflow.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _context(root: Path):
    # lazy: great_expectations takes seconds to import; only a quality run and its Data Docs need it
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="file", project_root_dir=str(root))
    bars = context.variables.progress_bars  # a config object, or a dict once reloaded from YAML
    if bars is None or (bars.get("globally", True) if isinstance(bars, dict) else bars.globally):
        context.variables.progress_bars = ProgressBarsConfig(globally=False)
        context.variables.save()
    return context


def validate(data_dir: Path, pipeline: str, sink: str, df, expectations: Sequence[ExpectationRun],
             run_name: str, run_time: datetime) -> GxOutcome:
    """Run ``expectations`` on ``df`` (a Spark DataFrame); results in the order given."""
    # lazy: great_expectations takes seconds to import; only a quality run and its Data Docs need it
    import great_expectations as gx
    from great_expectations.checkpoint import UpdateDataDocsAction

    root = gx_root(data_dir)
    name = f"{pipeline}.{sink}"
    with _locked(root):
        os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
        context = _context(root)
        source = context.data_sources.add_or_update_spark(name=DATASOURCE)
        try:
            asset = source.get_asset(name)
        except LookupError:
            asset = source.add_dataframe_asset(name=name)
        try:
            batch = asset.get_batch_definition(name)
        except (KeyError, LookupError):
            batch = asset.add_batch_definition_whole_dataframe(name)
        suite = gx.ExpectationSuite(name=name)
        for i, e in enumerate(expectations):
            exp = build_expectation(e.expectation, e.kwargs)
            exp.meta = {_META_KEY: i}
            suite.add_expectation(exp)
        suite = context.suites.add_or_update(suite)
        vd = context.validation_definitions.add_or_update(gx.ValidationDefinition(name=name, data=batch, suite=suite))
        checkpoint = context.checkpoints.add_or_update(gx.Checkpoint(
            name=name, validation_definitions=[vd], actions=[UpdateDataDocsAction(name="docs")],
            result_format={"result_format": "SUMMARY", "partial_unexpected_count": SAMPLE_SIZE}))
        run_id = gx.RunIdentifier(run_name=run_name, run_time=run_time)
        result = checkpoint.run(batch_parameters={"dataframe": df}, run_id=run_id)
        key, suite_result = next(iter(result.run_results.items()))
        by_index: dict[int, CheckResult] = {}
        for r in suite_result.results:
            i = (r.expectation_config.meta or {}).get(_META_KEY)
            if i is None:
                continue
            by_index[int(i)] = _check_result(expectations[int(i)], r)
        html = None
        for site in context.get_docs_sites_urls(resource_identifier=key):
            url = site.get("site_url") or ""
            page = Path(unquote(urlparse(url).path))
            if page.is_file():
                html = page.read_text(encoding="utf-8")
                page.unlink()
        try:
            context.validation_results_store.remove_key(key)
        except Exception as e:  # noqa: BLE001 - a leftover GX file is not worth failing the run
            log.warning("quality: could not remove GX's copy of validation %s: %s", key, e)
    results = [by_index.get(i) or CheckResult(e.name, False, details={"error": "GX returned no result"},
                                              origin=e.origin, engine="gx", kwargs=e.kwargs)
               for i, e in enumerate(expectations)]
    return GxOutcome(results, html, run_name)


def _check_result(e: ExpectationRun, r) -> CheckResult:
    res = r.result or {}
    details: dict[str, Any] = {k: res[k] for k in ("element_count", "unexpected_percent", "observed_value",
                                                   "missing_count") if k in res}
    info = r.exception_info or {}
    if info.get("raised_exception"):
        details["error"] = info.get("exception_message")
    count = res.get("unexpected_count")
    if count is None:
        count = 0 if r.success else 1
    samples = list(res.get("partial_unexpected_list") or [])
    if not samples and "observed_value" in res and not r.success:
        samples = [res["observed_value"]]
    return CheckResult(e.name, bool(r.success), int(count), samples[:SAMPLE_SIZE], details,
                       origin=e.origin, engine="gx", kwargs=e.kwargs)
