"""Encryption at rest (``jetstream.encryption``) on a real nats-server: isbflow.isb.encryption, the
embedded server's start and ``isb apply``'s toggle (isbflow.isb.provision_server)."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import pytest
import yaml

from isbflow.isb.connect import connect, resolve_settings
from isbflow.isb.provision import Action, ProvisionRefused
from isbflow.isb.server import EmbeddedNatsError, read_state, start_embedded, stop_embedded
from isbflow.spec import Specs, load_specs
from tests.helpers.provision import apply, publish, write_spec

MARKER = b"ZQX-encryption-marker-7f3a"


def _spec(tmp_path: Path, encryption: bool) -> Specs:
    path = write_spec(tmp_path, f"spec-{encryption}.yaml")
    docs = list(yaml.safe_load_all(path.read_text()))
    next(d for d in docs if d["kind"] == "InterStepBufferService")["spec"]["jetstream"]["encryption"] = encryption
    path.write_text(yaml.safe_dump_all(docs))
    return load_specs(path)


def _files_with(data_dir: Path, text: bytes) -> list[Path]:
    return [p for p in (data_dir / "nats").rglob("*") if p.is_file() and text in p.read_bytes()]


async def _messages(settings, stream: str) -> list[bytes]:
    nc = await connect(settings)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        return [(await js.get_msg(stream, seq)).data for seq in range(info.state.first_seq, info.state.last_seq + 1)]
    finally:
        await nc.close()


def _store_events(data_dir: Path, specs: Specs, cipher: str) -> None:
    """Start a server with ``cipher``, apply the spec, publish the marker on its source, stop."""
    start_embedded(data_dir, cipher=cipher)
    try:
        settings = resolve_settings(data_dir=data_dir)
        apply(settings, specs, data_dir=data_dir)
        publish(settings, "logs.events", 1)
        asyncio.run(_publish_marker(settings))
    finally:
        stop_embedded(data_dir)  # nats-server writes its blocks out when it stops


async def _publish_marker(settings) -> None:
    nc = await connect(settings)
    try:
        await nc.jetstream().publish("logs.events", MARKER)
    finally:
        await nc.close()


def test_an_encrypted_store_holds_no_event_text_where_a_plain_one_does(tmp_path):
    plain, encrypted = tmp_path / "plain", tmp_path / "encrypted"
    _store_events(plain, _spec(tmp_path, False), "none")
    _store_events(encrypted, _spec(tmp_path, True), "chachapoly")
    assert _files_with(plain, MARKER), "the plaintext store should show the event's text (else the check is blind)"
    assert not _files_with(encrypted, MARKER)
    key = encrypted / "nats" / "jetstream.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert _files_with(encrypted, key.read_bytes().strip()) == [key], "the key sits in no other file (configs, logs)"
    assert not (plain / "nats" / "jetstream.key").exists()


def test_a_restart_reuses_the_key_and_another_key_is_refused_keeping_the_store(tmp_path):
    data_dir = tmp_path / "d"
    _store_events(data_dir, _spec(tmp_path, True), "chachapoly")
    key = data_dir / "nats" / "jetstream.key"
    original = key.read_text()
    state = start_embedded(data_dir)  # no cipher named: the store's, with its key
    try:
        assert state.cipher == "chachapoly"
        assert MARKER in asyncio.run(_messages(resolve_settings(data_dir=data_dir), "src-logs-in"))
    finally:
        stop_embedded(data_dir)
    assert key.read_text() == original
    key.write_text("0" * 64)
    with pytest.raises(EmbeddedNatsError, match="is not the one they were written with"):
        start_embedded(data_dir)
    assert read_state(data_dir) is None  # stopped, nothing recorded
    with pytest.raises(EmbeddedNatsError, match="holds encrypted streams .* start it with jetstream.encryption"):
        start_embedded(data_dir, cipher="none")
    key.unlink()
    with pytest.raises(EmbeddedNatsError, match="key file .* is missing: restore it"):
        start_embedded(data_dir)
    key.write_text(original)
    start_embedded(data_dir)
    try:
        assert MARKER in asyncio.run(_messages(resolve_settings(data_dir=data_dir), "src-logs-in"))
    finally:
        stop_embedded(data_dir)


def test_turning_encryption_on_is_refused_without_force_and_recreates_drained_buffers_with_it(nats_server, tmp_path):
    settings, data_dir = nats_server.settings, nats_server.data_dir
    apply(settings, _spec(tmp_path, False), data_dir=data_dir)
    encrypted = _spec(tmp_path, True)
    with pytest.raises(ProvisionRefused, match=r"jetstream.encryption is on \(chachapoly\) in the spec .* --force"):
        apply(settings, encrypted, data_dir=data_dir)
    publish(settings, "logs.events", 2)
    with pytest.raises(ProvisionRefused, match=r"only once drained.*\n  src-logs-in: 2 unread"):
        apply(settings, encrypted, data_dir=data_dir, force=True)
    assert read_state(data_dir).cipher == "none"  # refused: the server as it was
    asyncio.run(_purge(settings, "src-logs-in"))  # the source read to its end
    report = apply(settings, encrypted, data_dir=data_dir, force=True)
    assert {r.action for r in report.resources} == {Action.RECREATED}
    assert read_state(data_dir).cipher == "chachapoly"
    publish(settings, "logs.events", 1)
    assert apply(settings, encrypted, data_dir=data_dir).resources[0].action == Action.UNCHANGED
    with pytest.raises(ProvisionRefused, match=r"jetstream.encryption is off in the spec"):
        apply(settings, _spec(tmp_path, False), data_dir=data_dir)


async def _purge(settings, stream: str) -> None:
    nc = await connect(settings)
    try:
        await nc.jetstream().purge_stream(stream)
    finally:
        await nc.close()
