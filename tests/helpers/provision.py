"""Provisioning helpers shared by the isb/, cli/ and airflow/ tests: small specs, stream infos,
publishing, one apply."""

from __future__ import annotations

import asyncio
from pathlib import Path

import yaml
from nats.js.errors import NotFoundError

from isbflow.isb import provision
from isbflow.isb.connect import connect
from isbflow.isb.provision import Action
from isbflow.spec import Specs, load_specs
from tests.conftest import ROOT

# The demo asks 2GiB per stream; the test servers' file store (10GiB) reserves
# maxBytes up front, so the tests use a small value.
SMALL = {"maxBytes": "64MiB"}


def write_spec(tmp_path: Path, name: str = "spec.yaml", source_stream: str | None = None, **stream) -> Path:
    """pipelines/logs.yaml with ``bufferConfig.stream`` fields overridden (and optionally the
    source's ``stream:`` named), written to tmp_path."""
    docs = list(yaml.safe_load_all((ROOT / "pipelines" / "logs.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "InterStepBufferService")
    service["spec"]["jetstream"]["bufferConfig"]["stream"].update({**SMALL, **stream})
    if source_stream:
        pipeline = next(d for d in docs if d["kind"] == "Pipeline")
        pipeline["spec"]["vertices"][0]["source"]["jetstream"]["stream"] = source_stream
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs))
    return path


def spec(tmp_path: Path, **stream) -> Specs:
    return load_specs(write_spec(tmp_path, f"spec-{len(list(tmp_path.iterdir()))}.yaml", **stream))


def stream_names(specs: Specs) -> list[str]:
    return [r.stream for r in provision.desired_resources(specs)]


async def _infos(settings, names):
    nc = await connect(settings)
    try:
        js = nc.jetstream()
        out = {}
        for n in names:
            try:
                out[n] = await js.stream_info(n)
            except NotFoundError:
                out[n] = None
        return out
    finally:
        await nc.close()


def infos(settings, specs):
    return asyncio.run(_infos(settings, stream_names(specs)))


async def _publish(settings, subject: str, count: int) -> None:
    nc = await connect(settings)
    try:
        js = nc.jetstream()
        for i in range(count):
            await js.publish(subject, f"m{i}".encode())
    finally:
        await nc.close()


def publish(settings, subject: str, count: int) -> None:
    asyncio.run(_publish(settings, subject, count))


def apply(settings, specs, **kw) -> provision.ProvisionReport:
    return asyncio.run(provision.apply(settings, specs, **kw))


def actions(report) -> dict[str, Action]:
    return {r.name: r.action for r in report.resources}


# ------------------------------------------------------------------ pure


def small_demo(tmp_path) -> Path:
    """A spec folder holding pipelines/logs.yaml with 64 MiB buffers.

    JetStream reserves ``maxBytes`` per stream up front; the demo's 2 GiB times its
    nine streams exceeds the test server's 10 GiB file store.
    """
    docs = list(yaml.safe_load_all((ROOT / "pipelines" / "logs.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "InterStepBufferService")
    service["spec"]["jetstream"]["bufferConfig"]["stream"]["maxBytes"] = "64MiB"
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "logs.yaml").write_text(yaml.safe_dump_all(docs))
    return folder
