"""A spec's ISB service started and stopped whichever store it uses (isbflow.ops.isb_service), and a
pipeline on a Redis service refused in one line where ops resolves its settings."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from isbflow.isb.redis import server as redis_server
from isbflow.isb.server import stop_embedded
from isbflow.local.procs import process_alive
from isbflow.ops import isb_service
from isbflow.ops.connection import IsbUnreachable, resolve_settings
from isbflow.spec import SpecError, load_specs


def spec(tmp_path: Path, body: str, name: str = "default", file: str = "isbsvc.yaml") -> Path:
    f = tmp_path / file
    f.write_text(f"kind: InterStepBufferService\nmetadata:\n  name: {name}\nspec:\n" + textwrap.indent(body, "  "))
    return f


def service(tmp_path: Path, body: str):
    return load_specs(spec(tmp_path, body)).services["default"]


@contextmanager
def cleanup(data_dir: Path) -> Iterator[None]:
    """Whatever the test did: the servers recorded under ``data_dir`` stopped by their PIDs."""
    try:
        yield
    finally:
        redis_server.stop_redis(data_dir)
        stop_embedded(data_dir)


def ping(up: isb_service.ServiceUp) -> redis.Redis:
    assert up.redis is not None
    return redis.Redis(host="127.0.0.1", port=up.redis.port, password=up.redis.password, socket_timeout=5)


def test_redis_native_starts_reuses_and_stops(tmp_path):
    svc = service(tmp_path, "redis:\n  native:\n    fsync: always\n    settings:\n      redis: |\n"
                            "        maxmemory 64mb\n        stream-node-max-entries 50\n")
    dd = tmp_path / "data"
    with cleanup(dd):
        first = isb_service.up(svc, dd)
        assert (first.store, first.started, first.fsync) == ("redis", True, "always")
        client = ping(first)
        try:
            assert client.ping() is True
            assert client.config_get("maxmemory") == {"maxmemory": str(64 * 2**20)}
            assert client.config_get("appendfsync") == {"appendfsync": "always"}
            assert client.config_get("stream-node-max-entries") == {"stream-node-max-entries": "50"}
        finally:
            client.close()
        anonymous = redis.Redis(host="127.0.0.1", port=first.redis.port, socket_timeout=5)
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.ping()
        anonymous.close()
        shown = first.to_json()
        assert first.redis.password not in str(shown) and shown["password_file"].endswith("redis/password")

        again = isb_service.up(svc, dd)
        assert not again.started and again.redis.pid == first.redis.pid

        stopped = isb_service.down(svc, dd)
        assert stopped.stopped == [first.redis.pid] and not process_alive(first.redis.pid)
        assert redis_server.read_state(dd) is None
        assert isb_service.down(svc, dd).stopped == []  # nothing recorded: nothing to do


def test_a_setting_the_server_refuses_stops_the_server_it_was_started_for(tmp_path):
    svc = service(tmp_path, "redis:\n  native:\n    settings:\n      redis: |\n        hz lots\n")
    dd = tmp_path / "data"
    with cleanup(dd):
        with pytest.raises(isb_service.IsbServiceError) as e:
            isb_service.up(svc, dd)
        assert "redis.native.settings.redis" in str(e.value) and "hz" in str(e.value)
        assert redis_server.read_state(dd) is None


def test_jetstream_embedded_starts_nats_server(tmp_path):
    svc = service(tmp_path, "jetstream:\n  url: embedded\n  settings:\n    max_file_store: 1GiB\n")
    dd = tmp_path / "data"
    with cleanup(dd):
        first = isb_service.up(svc, dd)
        assert (first.store, first.started, len(first.nats.nodes)) == ("jetstream", True, 1)
        assert all(first.nats.alive()) and first.nats.start_args["max_file_store"] == 2**30
        assert "password" not in first.to_json()
        again = isb_service.up(svc, dd)
        assert not again.started and again.nats.nodes[0].pid == first.nats.nodes[0].pid
        pid = first.nats.nodes[0].pid
        assert isb_service.down(svc, dd).stopped == [pid]
        assert not process_alive(pid)


@pytest.mark.parametrize("body,where", [
    ("jetstream:\n  url: nats://10.0.0.1:4222\n", "jetstream.url nats://10.0.0.1:4222"),
    ("redis:\n  external:\n    url: 10.0.0.1:6379\n", "redis.external.url 10.0.0.1:6379"),
])
def test_an_external_service_starts_nothing(tmp_path, body, where):
    svc = service(tmp_path, body)
    for verb in (isb_service.up, isb_service.down):
        with pytest.raises(isb_service.IsbServiceError) as e:
            verb(svc, tmp_path / "data")
        assert e.value.external and f"is external ({where}): isbflow starts nothing" in str(e.value)
    assert not (tmp_path / "data").exists()


def test_a_verb_that_does_not_serve_redis_is_refused_in_one_line_naming_itself(tmp_path):
    svc = service(tmp_path, "redis:\n  native: {}\n")
    with pytest.raises(IsbUnreachable) as e:  # the CLI's one line for an unusable service
        isb_service.require_jetstream(svc, "the buffer diff")
    assert isinstance(e.value, isb_service.NotRunnable)
    assert str(e.value).startswith("the buffer diff is not available on Redis buffers yet: ISB service 'default'")
    isb_service.require_jetstream(None, "x")
    isb_service.require_jetstream(service(tmp_path, "jetstream: {}\n"), "x")
    # the settings of a Redis service resolve: its pipelines run there
    with pytest.raises(IsbUnreachable, match="no Redis ISB service: nothing running under"):
        resolve_settings(data_dir=tmp_path, service=svc)

def test_the_service_is_picked_by_name_by_pipeline_or_as_the_only_one(tmp_path):
    one = spec(tmp_path, "redis:\n  native: {}\n", name="r")
    assert isb_service.pick_service(load_specs(one)).name == "r"
    two = [one, spec(tmp_path, "jetstream: {}\n", name="j", file="j.yaml")]
    with pytest.raises(SpecError, match="name one with --service"):
        isb_service.pick_service(load_specs(two))
    assert isb_service.pick_service(load_specs(two), "j").store == "jetstream"
    with pytest.raises(SpecError, match="no InterStepBufferService named 'x'"):
        isb_service.pick_service(load_specs(two), "x")
