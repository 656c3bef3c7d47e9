"""One class-data-sharing (AppCDS) archive of Spark's classes for every JVM the suite starts.

The suite starts many short-lived Spark JVMs (the in-process session, every Airflow task's
and every detached driver's). Each loads and verifies ~15,000 classes from Spark's jars
before it does any work. A dynamic CDS archive (JDK 13+, ``-XX:ArchiveClassesAtExit``)
written once by a warm-up JVM (:mod:`tests.helpers.jvm_warmup`) lets the later JVMs map
those classes, already parsed and verified, instead. Measured here (a session, an
aggregation, a Python UDF, ``local[2]``, C1 only and the serial collector): the JVM's CPU
went from 9.3-9.5 to 5.0-5.4 seconds.

The archive is keyed by the Java version, PySpark's version, the jar list and the JVM
options it is used with, and cached under ``~/.cache/isbflow-tests/`` (a clean machine builds
it once, in ~15 s). The JVM checks an archive's class path itself: a JVM whose class path
does not start with the archive's simply runs without it (``-Xshare:auto``, the default).
If the archive cannot be built the suite runs without it and says so once on stderr.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "isbflow-tests"
#: quiet: a JVM that cannot use the archive (another class path) says nothing in a driver's log
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"


def _key(base_opts: str) -> str:
    import pyspark

    java = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=60).stderr
    jars = sorted(p.name for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar"))
    h = hashlib.sha256("\n".join([java, pyspark.__version__, base_opts, *jars]).encode())
    return h.hexdigest()[:16]


def build_archive(base_opts: str) -> Path | None:
    """The archive for JVMs started with ``base_opts``: cached, else written by a warm-up JVM."""
    try:
        archive = CACHE / f"spark-{_key(base_opts)}.jsa"
    except (OSError, subprocess.SubprocessError) as e:
        print(f"jvm_cds: no archive ({e}); JVMs start without one", file=sys.stderr)
        return None
    if archive.exists():
        return archive
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = archive.with_suffix(f".{os.getpid()}.partial")
    env = dict(os.environ, SPARK_SUBMIT_OPTS=f"{base_opts} -XX:ArchiveClassesAtExit={partial} {QUIET}")
    try:
        r = subprocess.run([sys.executable, "-m", "tests.helpers.jvm_warmup"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        r = None
    if r is None or r.returncode != 0 or not partial.exists():
        tail = "timed out" if r is None else (r.stderr or "")[-2000:]
        print(f"jvm_cds: the warm-up JVM wrote no archive; JVMs start without one:\n{tail}",
              file=sys.stderr)
        partial.unlink(missing_ok=True)
        return None
    partial.replace(archive)
    return archive


def with_archive(base_opts: str) -> str:
    """``base_opts`` plus the archive's options (just ``base_opts`` when there is none)."""
    archive = build_archive(base_opts)
    return f"{base_opts} -XX:SharedArchiveFile={archive} {QUIET}" if archive else base_opts
