"""Hadoop's local file system without a ``chmod`` process per file: isbflow's own
``io.isbflow.hadoop.LocalFileSystem`` (``java/``), compiled once per machine and set as
``fs.file.impl`` by :func:`isbflow.steps.session.spark_session` on a local master.

Why: pip's PySpark ships no Hadoop native library, so Hadoop's ``RawLocalFileSystem`` sets the
permissions of every file and directory it creates by running ``chmod`` (the JVM spawns
``jspawnhelper``, which searches ``PATH`` for ``chmod``). Measured in one JVM, 300 files created
through Hadoop's file system from py4j, two runs of two rounds each: 11.4-13.8 ms CPU (JVM and its
children) per file with Hadoop's class, 2.0-3.7 ms with this one. A micro-batch creates several:
its offset and commit files and their ``.crc`` twins, a write job's temporary directories, the
sink's part files. The class sets the same permissions (the umask applied by Hadoop, as before)
through ``java.nio``; with Hadoop's native library present, or for a sticky bit, it does what
Hadoop does.

The class is compiled with the JDK's ``javac`` against the installed Spark's Hadoop API jar into
the jar ``$XDG_CACHE_HOME/isbflow/jvm/<digest>.jar`` (about 2 s, once per source and jar): a jar,
not a directory of classes, because a JVM cannot write a class-data-sharing archive
(``-XX:ArchiveClassesAtExit``) with a non-empty directory on its class path. Without a ``javac``
(a JRE only) or when compiling fails, :func:`classpath` returns ``None`` and says why once: Spark
then uses Hadoop's own class, as it always did. ``ISBFLOW_HADOOP_LOCAL_FS=hadoop`` asks for
Hadoop's class too.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

CLASS = "io.isbflow.hadoop.LocalFileSystem"
SOURCE = Path(__file__).parent / "java" / "io" / "isbflow" / "hadoop" / "LocalFileSystem.java"
#: how long compiling may take before it counts as failed
COMPILE_TIMEOUT_S = 120
ENV_SWITCH = "ISBFLOW_HADOOP_LOCAL_FS"


def spark_jars() -> Path:
    """The jars of the Spark that PySpark starts: ``$SPARK_HOME/jars``, else the installed pyspark's."""
    home = os.environ.get("SPARK_HOME")
    if home:
        return Path(home) / "jars"
    import pyspark  # lazy: only a session that starts its JVM asks

    return Path(pyspark.__file__).parent / "jars"


def find_javac() -> str | None:
    """The JDK's ``javac``: ``$JAVA_HOME/bin``, then ``PATH``, then beside the ``java`` on ``PATH``."""
    home = os.environ.get("JAVA_HOME")
    candidates = [Path(home) / "bin" / "javac"] if home else []
    on_path = shutil.which("javac")
    if on_path:
        candidates.append(Path(on_path))
    java = shutil.which("java")
    if java:
        candidates.append(Path(java).resolve().parent / "javac")
    return next((str(c) for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "isbflow" / "jvm"


def compile_class(javac: str, api_jar: Path, root: Path) -> Path:
    """Compile :data:`SOURCE` against ``api_jar`` into the jar ``root/<digest>.jar`` (kept: the next
    session uses it) and return it. Concurrent sessions each compile in a directory of their own and
    link their jar into place; the first one wins, and a jar in place is never replaced (a JVM's
    class-data-sharing archive names it by size and time)."""
    digest = hashlib.sha256(SOURCE.read_bytes() + api_jar.name.encode()).hexdigest()[:16]
    final = root / f"{digest}.jar"
    if final.is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=root))
    try:
        classes = work / "classes"
        done = subprocess.run([javac, "-nowarn", "--release", "17", "-cp", str(api_jar), "-d", str(classes),
                               str(SOURCE)], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{javac} failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-500:]}")
        jar = work / "classes.jar"
        with zipfile.ZipFile(jar, "w", zipfile.ZIP_DEFLATED) as z:
            for f in sorted(classes.rglob("*.class")):
                z.write(f, f.relative_to(classes).as_posix())
        try:
            os.link(jar, final)
        except FileExistsError:
            pass  # another session's jar, the same source compiled: keep it
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


@functools.cache
def classpath() -> str | None:
    """The jar holding :data:`CLASS`, compiled when needed; ``None`` (said once, at INFO) when it
    cannot be had or :data:`ENV_SWITCH` is ``hadoop``."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() == "hadoop":
        return None
    jars = sorted(spark_jars().glob("hadoop-client-api-*.jar"))
    javac = find_javac()
    if not jars or javac is None:
        log.info("Hadoop's local file system keeps its chmod process per file: %s",
                 "no javac (a JDK) found" if javac is None else f"no hadoop-client-api jar in {spark_jars()}")
        return None
    try:
        return str(compile_class(javac, jars[-1], cache_root()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.info("Hadoop's local file system keeps its chmod process per file: compiling %s failed: %s", CLASS, e)
        return None
