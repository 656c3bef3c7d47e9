"""A throwaway PostgreSQL cluster for tests, from Debian's server binaries (moved here from
tests/airflow/test_postgres.py so the PostgreSQL sink's tests start the same server).

:func:`running_postgres` makes it: ``initdb`` (password auth, scram-sha-256, a
generated password in an owner-only file) in a temporary folder, then
``postgres`` listening on 127.0.0.1 on a free port only (its Unix socket in that
folder), stopped by PID on exit. ``initdb`` refuses to run as root, so under
root both run as the unprivileged ``postgres`` user (``nobody`` if there is
none) through ``setpriv``; the cluster's folder is outside pytest's root-only
temp tree so that user can reach it. The binaries come from ``scripts/ensure-postgres``
(run by ``make test``), which installs Debian's ``postgresql`` when missing.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from isbflow.isb.server import free_port

HOST = "127.0.0.1"
DB, USER = "airflow", "airflow"


@dataclass
class Postgres:
    folder: Path
    port: int
    password: str
    pid: int
    db: str = DB
    user: str = USER
    command: list[str] | None = None  # how the server was started (stop() and start() again)
    proc: subprocess.Popen | None = None

    def stop(self) -> None:
        """Stop the server (fast shutdown), its data kept: clients get "connection refused"."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)
            self.proc.wait(timeout=60)

    def start(self) -> None:
        """Start the stopped server again on the same port and data."""
        assert self.command is not None and (self.proc is None or self.proc.poll() is not None)
        log = self.folder / "postgres.log"
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid
        _wait_ready(self, self.proc, log)

    def url(self, driver: str = "postgresql+psycopg2") -> str:
        return f"{driver}://{self.user}:{self.password}@{HOST}:{self.port}/{self.db}"

    def query(self, sql: str) -> list[tuple]:
        import psycopg2

        with psycopg2.connect(host=HOST, port=self.port, user=self.user, password=self.password,
                              dbname=self.db) as c:
            with c.cursor() as cur:
                cur.execute(sql)
                return cur.fetchall()


def _run_as() -> tuple[list[str], int | None, int | None]:
    """How to run PostgreSQL's programs: as is, or (as root) through setpriv as an unprivileged user."""
    if os.geteuid() != 0:
        return [], None, None
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("running as root and setpriv (util-linux) is missing: initdb refuses root")
    for name in ("postgres", "nobody"):
        try:
            u = pwd.getpwnam(name)
        except KeyError:
            continue
        return [setpriv, f"--reuid={u.pw_uid}", f"--regid={u.pw_gid}", "--clear-groups"], u.pw_uid, u.pw_gid
    pytest.fail("running as root with neither a 'postgres' nor a 'nobody' user to run initdb as")


def _binary(name: str) -> str:
    found = shutil.which(name) or next((str(p) for p in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))),
                                       None)
    if found is None:
        pytest.fail(f"PostgreSQL's {name} is not installed: scripts/ensure-postgres (run by make test) installs it")
    return found


def _wait_ready(pg: Postgres, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    import psycopg2

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"postgres exited with {proc.returncode}; log {log}:\n{log.read_text()[-2000:]}")
        try:
            psycopg2.connect(host=HOST, port=pg.port, user=pg.user, password=pg.password, dbname="postgres",
                             connect_timeout=2).close()
            return
        except psycopg2.OperationalError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres not accepting connections after {timeout:.0f}s; log {log}:\n"
                                   f"{log.read_text()[-2000:]}") from None
            time.sleep(0.3)


@contextmanager
def running_postgres(db: str = DB, user: str = USER) -> Iterator[Postgres]:
    """A PostgreSQL cluster on 127.0.0.1:<free port> with database ``db`` owned by ``user``."""
    prefix, uid, gid = _run_as()
    initdb, server = _binary("initdb"), _binary("postgres")
    folder = Path(tempfile.mkdtemp(prefix="isbflow-pg-"))
    pg = None
    try:
        data, pwfile = folder / "data", folder / "pwfile"
        password = secrets.token_urlsafe(18)
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        if uid is not None:
            for p in (folder, pwfile):
                os.chown(p, uid, gid)
        os.chmod(folder, 0o700)
        r = subprocess.run([*prefix, initdb, "-D", str(data), "-U", user, f"--pwfile={pwfile}",
                            "--auth=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"initdb failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        pwfile.unlink()
        port = free_port()
        command = [*prefix, server, "-D", str(data), "-p", str(port), "-k", str(folder),
                   "-c", f"listen_addresses={HOST}", "-c", "max_connections=50",
                   "-c", "fsync=off"]  # a throwaway cluster: speed over durability
        pg = Postgres(folder, port, password, 0, db=db, user=user, command=command)
        pg.start()
        import psycopg2

        c = psycopg2.connect(host=HOST, port=port, user=user, password=password, dbname="postgres")
        c.autocommit = True
        c.cursor().execute(f"CREATE DATABASE {db} OWNER {user}")
        c.close()
        yield pg
    finally:
        proc = pg.proc if pg is not None else None  # the one running now (a test may have restarted it)
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)  # PostgreSQL's fast shutdown
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)
