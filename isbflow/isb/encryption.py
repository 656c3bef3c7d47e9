"""Encryption at rest of the embedded server's JetStream store (``jetstream.encryption``).

nats-server encrypts a store when its config has ``jetstream { cipher: chachapoly | aes, key: ... }``.
The key is generated once into ``<data dir>/nats/jetstream.key`` (owner-only, next to the
passwords) and handed to the server through the environment, so it sits in no config file;
the cipher the store was last started with is recorded in ``<data dir>/nats/encryption.json``,
and a start that names no cipher keeps it.

What nats-server 2.15.1 does, measured (and what isbflow does about it):

- started with a key over plaintext streams, it encrypts them in place, messages kept;
- started with another key, or without one, over encrypted streams, it starts healthy but
  without them (each logged ``Error decrypting our stream metafile``): the streams look
  gone, and re-creating them would write over the old files. isbflow therefore refuses to
  start over streams written in the other mode (:func:`check_store`: turning encryption on
  or off goes through ``isbflow isb apply --force`` once the buffers are drained), refuses
  to generate a new key over encrypted streams, and stops a server that logged a decryption
  error (:func:`decrypt_errors`), keeping the store as it was;
- it reports encryption to no client: not in INFO, ``$JS.API.INFO``, stream info, ``/varz``
  or ``/jsz``. The embedded server's cipher is what isbflow recorded starting it.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from isbflow.spec.paths import private_secret, write_private

#: no encryption at rest
PLAIN = "none"
#: nats-server's ciphers (``jetstream { cipher }``)
CIPHERS = ("chachapoly", "aes")
KEY_FILE = "jetstream.key"
MODE_FILE = "encryption.json"
#: the variable the node configs read the key from (``key: $ISBFLOW_JETSTREAM_KEY``)
KEY_ENV = "ISBFLOW_JETSTREAM_KEY"
#: what nats-server logs for each stream it cannot decrypt
DECRYPT_ERROR = "Error decrypting"


class EncryptionRefused(Exception):
    """The store was written in another encryption mode or with another key (message says what to do)."""


def recorded_cipher(ndir: Path) -> str:
    """The cipher the store under ``ndir`` was last started with, :data:`PLAIN` when none."""
    try:
        return json.loads((ndir / MODE_FILE).read_text())["cipher"]
    except (OSError, ValueError, KeyError, TypeError):
        return PLAIN


def record_cipher(ndir: Path, cipher: str) -> None:
    write_private(ndir / MODE_FILE, json.dumps({"cipher": cipher}))


def key(ndir: Path) -> str:
    """The store's key (``ndir/jetstream.key``, owner-only), generated on first use and kept."""
    return private_secret(ndir / KEY_FILE, lambda: secrets.token_hex(32))


def config_line(cipher: str) -> str:
    """What a node's ``jetstream { ... }`` block adds for ``cipher`` ("" for :data:`PLAIN`)."""
    return "" if cipher == PLAIN else f", cipher: {cipher}, key: ${KEY_ENV}"


def environment(ndir: Path, cipher: str) -> dict[str, str]:
    """The variables a node needs for ``cipher``: the key, quoted so nats-server reads it as a string."""
    return {} if cipher == PLAIN else {KEY_ENV: f'"{key(ndir)}"'}


def stream_dirs(stores: list[Path]) -> tuple[list[Path], list[Path]]:
    """(encrypted, plaintext) stream folders of the JetStream stores ``stores``: nats-server writes
    a ``meta.key`` beside an encrypted stream's metadata."""
    encrypted: list[Path] = []
    plain: list[Path] = []
    for store in stores:
        for meta in sorted(store.glob("jetstream/*/streams/*/meta.inf")):  # nats-server adds "jetstream/"
            (encrypted if (meta.parent / "meta.key").exists() else plain).append(meta.parent)
    return encrypted, plain


_TOGGLE = ("turning jetstream.encryption {what} recreates every buffer: drain the pipelines "
           "('isbflow pipeline drain -f SPEC'), then run 'isbflow isb apply -f SPEC --force' with the server "
           "running as it is")


def check_store(ndir: Path, stores: list[Path], cipher: str) -> None:
    """Refuse (:class:`EncryptionRefused`) to start with ``cipher`` over streams written in the other
    mode, or over encrypted streams whose key file is gone."""
    encrypted, plain = stream_dirs(stores)
    names = lambda dirs: ", ".join(sorted({d.name for d in dirs})[:5]) + (", ..." if len(dirs) > 5 else "")  # noqa: E731
    if cipher == PLAIN and encrypted:
        raise EncryptionRefused(
            f"the JetStream store under {ndir} holds encrypted streams ({names(encrypted)}) and the server would "
            f"start without encryption, so they could not be read: start it with jetstream.encryption: true (the "
            f"cipher it had: {recorded_cipher(ndir)}); {_TOGGLE.format(what='off')}")
    if cipher != PLAIN and plain:
        raise EncryptionRefused(
            f"the JetStream store under {ndir} holds unencrypted streams ({names(plain)}) and the server would "
            f"start with jetstream.encryption ({cipher}): start it as it was (without encryption); "
            f"{_TOGGLE.format(what='on')}")
    if encrypted and not (ndir / KEY_FILE).exists():
        raise EncryptionRefused(
            f"the JetStream store under {ndir} holds encrypted streams ({names(encrypted)}) but their key file "
            f"{ndir / KEY_FILE} is missing: restore it from a backup (isbflow never generates a new key over an "
            "encrypted store: the streams could not be read with it)")


def log_size(log: Path) -> int:
    """Where a node's log ends now (its lines after this offset are the next start's)."""
    try:
        return log.stat().st_size
    except OSError:
        return 0


def decrypt_errors(log: Path, offset: int) -> list[str]:
    """The lines of ``log`` after ``offset`` where nats-server says it could not decrypt a stream."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read(1 << 20).decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if DECRYPT_ERROR in line]


def wrong_key_message(ndir: Path, errors: list[str]) -> str:
    return (f"nats-server could not decrypt {len(errors)} stream(s) of its store under {ndir} and was stopped, "
            f"the store kept as it was: the key in {ndir / KEY_FILE} is not the one they were written with "
            f"(log: {errors[0].strip()}). Restore the key file they were written with and start again")


