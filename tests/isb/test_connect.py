"""Connecting to the ISB service: where settings come from, one clear line when
it fails, secrets never shown, and TLS end to end against a real nats-server."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import re
from dataclasses import replace
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from isbflow.isb.connect import (
    IsbUnreachable,
    NatsSettings,
    connect,
    resolve_settings,
    run_kept,
    run_with,
    settings_from_url,
)
from isbflow.isb.server import HOST, free_port, start_embedded, stop_embedded
from isbflow.spec.models import InterStepBufferService
from isbflow.spec.paths import SECRETS_ENV


def _service(**jetstream) -> InterStepBufferService:
    return InterStepBufferService.model_validate(
        {"kind": "InterStepBufferService", "metadata": {"name": "default"}, "spec": {"jetstream": jetstream}}
    )


async def _roundtrip(settings: NatsSettings) -> bytes:
    nc = await connect(settings)
    try:
        sub = await nc.subscribe("ping")
        await nc.publish("ping", b"pong")
        return (await sub.next_msg(timeout=5)).data
    finally:
        await nc.close()


def _anonymous(url: str) -> str:
    return "nats://" + url.split("@", 1)[1]


def test_unreachable_url_is_one_line():
    url = f"nats://{HOST}:{free_port()}"
    with pytest.raises(IsbUnreachable) as e:
        asyncio.run(connect(settings_from_url(url), timeout=3))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"cannot reach the ISB service at {url}: ")
    assert "Connect call failed" in msg or "refused" in msg.lower()


def test_url_with_credentials_works(nats_server):
    assert "@" in nats_server.url
    assert asyncio.run(_roundtrip(settings_from_url(nats_server.url))) == b"pong"


def test_wrong_password_and_anonymous_are_refused(nats_server):
    user_at = nats_server.url.split("@", 1)[0]  # nats://isbflow:<password>
    wrong = user_at.rsplit(":", 1)[0] + ":not-the-password@" + nats_server.url.split("@", 1)[1]
    for url in (wrong, _anonymous(nats_server.url)):
        with pytest.raises(IsbUnreachable) as e:
            asyncio.run(connect(settings_from_url(url)))
        assert "refused" in str(e.value) and "authorization" in str(e.value)
        assert "not-the-password" not in str(e.value)


def test_credentials_from_spec_file(nats_server, tmp_path, monkeypatch):
    monkeypatch.delenv(SECRETS_ENV, raising=False)
    password = nats_server.state.password
    (tmp_path / "none" / "secrets").mkdir(parents=True)
    creds = tmp_path / "none" / "secrets" / "userpass"
    creds.write_text(f"isbflow:{password}\n")
    for path in (str(creds), "secrets/userpass"):  # relative: to the data dir
        service = _service(url=_anonymous(nats_server.url), auth={"userPasswordFile": path})
        settings = resolve_settings(service=service, data_dir=tmp_path / "none")
        assert settings.user == "isbflow" and settings.password == password
    assert asyncio.run(_roundtrip(settings)) == b"pong"


def test_spec_named_secret_files_only_from_the_secrets_folder(nats_server, tmp_path, monkeypatch):
    """auth files must not send an owner-only file of this host (the embedded server's admin
    password) to the server the spec names: only files in the secrets folder, symlinks resolved."""
    monkeypatch.delenv(SECRETS_ENV, raising=False)
    admin = nats_server.data_dir / "nats" / "password"
    assert admin.is_file()
    secrets = nats_server.data_dir / "secrets"
    secrets.mkdir()
    (secrets / "escape").symlink_to(admin)
    url = "nats://attacker.example:4222"
    for field in ("tokenFile", "userPasswordFile", "credsFile"):
        for path in (str(admin), "nats/password", "secrets/escape"):
            service = _service(url=url, auth={field: path})
            with pytest.raises(IsbUnreachable, match=rf"jetstream.auth.{field} '{re.escape(path)}' is outside the "
                               rf"secrets folder {re.escape(str(secrets))}.*ISBFLOW_SECRETS_DIR"):
                resolve_settings(service=service, data_dir=nats_server.data_dir)
    monkeypatch.setenv(SECRETS_ENV, str(admin.parent))  # a configured folder
    token = resolve_settings(service=_service(url=url, auth={"tokenFile": str(admin)}), data_dir=nats_server.data_dir)
    assert token.token == nats_server.state.password


def test_reconnects_after_connecting(nats_server):
    async def go() -> int:
        nc = await connect(nats_server.settings, reconnect_attempts=-1)
        try:
            return nc.options["max_reconnect_attempts"]
        finally:
            await nc.close()

    assert asyncio.run(go()) == -1


def test_run_kept_keeps_one_connection_and_connects_again_when_it_fails(nats_server, monkeypatch):
    """A sink's commit records in the ledger every micro-batch: on one kept connection, not one each
    (run_with's), again after the server restarted, and anew after an idle spell."""
    import isbflow.isb.connect as connect_module

    async def client_id(nc) -> int:
        await nc.flush()
        return nc.client_id

    s = nats_server.settings
    fresh = {run_with(s, client_id) for _ in range(3)}
    assert len(fresh) == 3  # the comparison: a connection a call
    kept = {run_kept(s, client_id, name="t") for _ in range(3)}
    assert len(kept) == 1
    assert run_kept(s, client_id, name="other") not in kept  # one connection per name

    stop_embedded(nats_server.data_dir)  # the server goes away under the kept connection
    start_embedded(nats_server.data_dir)  # and comes back on the same port
    after = run_kept(s, client_id, name="t")  # the kept connection fails; a fresh one answers
    assert after == run_kept(s, client_id, name="t")

    monkeypatch.setattr(connect_module, "KEPT_IDLE_S", 0.0)
    assert len({run_kept(s, client_id, name="t") for _ in range(2)}) == 2  # idle too long: connected anew


def test_resolve_precedence(nats_server, monkeypatch):
    monkeypatch.delenv("NATS_URL", raising=False)
    for var in ("NATS_CREDS", "NATS_USER", "NATS_PASSWORD", "NATS_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    dd = nats_server.data_dir
    spec = _service(url="nats://spec-host:4222")
    embedded = _service(url="embedded")

    assert resolve_settings(data_dir=dd, service=embedded).servers == tuple(nats_server.state.urls)
    assert resolve_settings(data_dir=dd).servers == tuple(nats_server.state.urls)
    assert resolve_settings(data_dir=dd, service=spec).servers == ("nats://spec-host:4222",)
    monkeypatch.setenv("NATS_URL", "nats://env-host:4222")
    assert resolve_settings(data_dir=dd, service=spec).servers == ("nats://env-host:4222",)
    assert resolve_settings("nats://a:1,nats://b:2", dd, spec).servers == ("nats://a:1", "nats://b:2")


def test_nothing_to_connect_to(tmp_path, monkeypatch):
    monkeypatch.delenv("NATS_URL", raising=False)
    with pytest.raises(IsbUnreachable, match="isbflow nats up"):
        resolve_settings(data_dir=tmp_path)


def test_password_never_shown(nats_server):
    password = nats_server.state.password
    settings = nats_server.settings
    assert password in settings.servers[0]  # it is there to be used ...
    for text in (settings.display, repr(settings), str(settings),
                 repr(settings.with_auth_from_urls()), repr(replace(settings, token="tok-secret"))):
        assert password not in text and "tok-secret" not in text  # ... never to be shown
    assert settings.display == nats_server.url.replace(password, "***")
    kw = settings.connect_kwargs()
    assert kw["user"] == "isbflow" and kw["password"] == password and "@" not in kw["servers"][0]


def test_url_credentials_are_decoded():
    s = settings_from_url("nats://me:p%40ss%3Aword@h:4222").with_auth_from_urls()
    assert (s.user, s.password, s.servers) == ("me", "p@ss:word", ("nats://h:4222",))
    t = settings_from_url("nats://s3cr3t-token@h:4222").with_auth_from_urls()
    assert (t.token, t.user, t.servers) == ("s3cr3t-token", None, ("nats://h:4222",))
    assert "s3cr3t" not in repr(t) and "s3cr3t" not in settings_from_url("nats://s3cr3t-token@h:4222").display


# -------------------------------------------------------------------- TLS


def _cert_files(folder: Path) -> dict[str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it."""
    now = datetime.datetime.now(datetime.UTC)

    def build(subject: str, issuer: x509.Name | None, key, issuer_key, ca: bool) -> x509.Certificate:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        b = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            b = b.add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), True)
        else:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address(HOST)), x509.DNSName("localhost")]), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    ca_key, srv_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = build("isbflow test CA", None, ca_key, ca_key, ca=True)
    srv = build("isbflow test server", ca.subject, srv_key, ca_key, ca=False)
    files = {"ca": folder / "ca.pem", "cert": folder / "server.pem", "key": folder / "server-key.pem"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(srv.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(srv_key.private_bytes(serialization.Encoding.PEM,
                                                   serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    return {k: str(v) for k, v in files.items()}


@pytest.fixture
def tls_server(tmp_path):
    tls = _cert_files(tmp_path)
    data_dir = tmp_path / "home"
    state = start_embedded(data_dir, tls=tls)
    try:
        yield data_dir, state, tls
    finally:
        stop_embedded(data_dir)


def test_tls_end_to_end(tls_server, monkeypatch):
    monkeypatch.delenv("NATS_URL", raising=False)
    data_dir, state, tls = tls_server
    assert state.urls[0].startswith("tls://isbflow:")
    settings = resolve_settings(data_dir=data_dir)
    assert settings.tls_ca == tls["ca"]
    assert asyncio.run(_roundtrip(settings)) == b"pong"

    # the CA can also come from the spec, with the URL given explicitly
    service = _service(url="embedded", tls={"caFile": tls["ca"]})
    assert asyncio.run(_roundtrip(resolve_settings(state.url, data_dir, service))) == b"pong"

    # without our CA the server's certificate is not trusted: one clear line
    with pytest.raises(IsbUnreachable) as e:
        asyncio.run(connect(replace(settings, tls_ca=None)))
    assert "TLS failed" in str(e.value) and "certificate verify failed" in str(e.value)
    assert state.password not in str(e.value)


def test_tls_needs_existing_files(tmp_path):
    from isbflow.isb.server import EmbeddedNatsError

    with pytest.raises(EmbeddedNatsError, match="missing: cert, key"):
        start_embedded(tmp_path, tls={"ca": __file__})


def test_a_server_that_never_answers_times_out_with_one_line():
    """A listener that accepts and says nothing: the first connection gives up at its timeout."""
    import socket

    silent = socket.socket()
    silent.bind((HOST, 0))
    silent.listen(4)
    url = f"nats://{HOST}:{silent.getsockname()[1]}"
    try:
        with pytest.raises(IsbUnreachable) as e:
            asyncio.run(connect(settings_from_url(url), timeout=1))
        assert str(e.value) == f"cannot reach the ISB service at {url}: timed out"
    finally:
        silent.close()
