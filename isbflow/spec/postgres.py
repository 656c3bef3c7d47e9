"""The ``sink.postgres`` model: a PostgreSQL table a sink writes (:mod:`isbflow.sinks.postgres`).

Where the server is comes from exactly one of:

- ``connection``: an Airflow connection id (conn type ``postgres``; a connection
  of any other type is refused, never passed to the driver). The step's driver
  reads it from ``AIRFLOW_CONN_<ID>`` (Airflow's own environment form, URI or
  JSON), so the password lives where Airflow keeps it;
- ``dsn``: a libpq connection string or ``postgresql://`` URI **without a
  password**, plus ``passwordFile`` (an owner-only file in the secrets folder,
  :func:`isbflow.spec.paths.secrets_dir`; relative to the data dir) or
  ``passwordEnv`` (an environment variable's name) when the server asks for one.

No password is ever in the spec (a ``dsn`` holding one is refused) nor in
Spark's options: the driver resolves it when it connects.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlsplit

from pydantic import field_validator, model_validator

from isbflow.spec.fields import SpecModel, one_of_message

#: ``table`` or ``schema.table``, plain identifiers (no quoting needed, none allowed)
TABLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?\Z")
CONNECTION_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}\Z")
ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
WHERE = ("connection", "dsn")


#: libpq's secret keywords: the password, and the passphrase of the client's SSL key
SECRET_KEYWORDS = ("password", "sslpassword")
#: the platform's own variables, which ``passwordEnv`` may not name (they hold its credentials)
PLATFORM_ENV_PREFIXES = ("ISBFLOW_", "NATS_", "AIRFLOW_", "AIRFLOW__", "SPARK_", "PYSPARK_")


def dsn_has_password(dsn: str) -> bool:
    """Whether a libpq keyword string or a ``postgres(ql)://`` URI carries a password or an SSL key
    passphrase (``sslpassword``)."""
    if dsn.startswith(("postgres://", "postgresql://")):
        parts = urlsplit(dsn)
        return parts.password is not None or any(k in parse_qs(parts.query) for k in SECRET_KEYWORDS)
    return re.search(r"(^|\s)(ssl)?password\s*=", dsn) is not None


class PostgresSink(SpecModel):
    """A PostgreSQL table; created from the step's output schema when missing."""

    table: str
    """``table`` or ``schema.table``: plain identifiers, at most 63 characters each."""
    connection: str | None = None
    """An Airflow connection id of type ``postgres`` (read from ``AIRFLOW_CONN_<ID>``); or give ``dsn``."""
    dsn: str | None = None
    """A libpq connection string or ``postgresql://`` URI without a password; or give ``connection``."""
    passwordFile: str | None = None
    """With ``dsn``: an owner-only file holding the password. Default: none."""
    passwordEnv: str | None = None
    """With ``dsn``: the name of an environment variable holding the password. Default: none."""

    @field_validator("table")
    @classmethod
    def _table(cls, v: str) -> str:
        if not TABLE_RE.match(v):
            raise ValueError(f"{v!r} must be 'table' or 'schema.table' (letters, digits, '_'; at most 63 each)")
        return v

    @field_validator("connection")
    @classmethod
    def _connection(cls, v: str | None) -> str | None:
        if v is not None and not CONNECTION_RE.match(v):
            raise ValueError(f"{v!r} is not an Airflow connection id (letters, digits, '_', '.', '-')")
        return v

    @field_validator("dsn")
    @classmethod
    def _dsn(cls, v: str | None) -> str | None:
        if v is not None and dsn_has_password(v):
            raise ValueError("holds a password: keep it out of the spec; use passwordFile or passwordEnv, "
                             "or an Airflow connection (connection: <id>)")
        return v

    @field_validator("passwordEnv")
    @classmethod
    def _env(cls, v: str | None) -> str | None:
        if v is not None and not ENV_RE.match(v):
            raise ValueError(f"{v!r} is not an environment variable name")
        if v is not None and v.upper().startswith(PLATFORM_ENV_PREFIXES):
            raise ValueError(f"{v!r} is one of the platform's own variables ({', '.join(PLATFORM_ENV_PREFIXES)}...), "
                             "which hold its credentials; name a variable of your own")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> PostgresSink:
        found = [k for k in WHERE if getattr(self, k) is not None]
        if len(found) != 1:
            raise ValueError(one_of_message("a postgres sink", WHERE, found))
        if self.connection is not None and (self.passwordFile or self.passwordEnv):
            raise ValueError("passwordFile/passwordEnv go with dsn; an Airflow connection holds its own password")
        if self.passwordFile and self.passwordEnv:
            raise ValueError("give passwordFile or passwordEnv, not both")
        return self
