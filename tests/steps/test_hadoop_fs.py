"""isbflow's Hadoop local file system (:mod:`isbflow.steps.hadoop_fs`): no ``chmod`` process per file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import zipfile

import pytest

from isbflow.steps import hadoop_fs
from isbflow.steps.session import CLASSPATH_CONF, LOCAL_FS_CONF, local_fs_conf

pytestmark = pytest.mark.slow


def test_the_class_is_compiled_once_into_the_cache_and_reused(tmp_path):
    javac = hadoop_fs.find_javac()
    assert javac is not None, "a JDK's javac is a prerequisite (README): none found"
    jar = sorted(hadoop_fs.spark_jars().glob("hadoop-client-api-*.jar"))[-1]
    where = hadoop_fs.compile_class(javac, jar, tmp_path)
    # a jar, not a directory: a JVM cannot write a CDS archive with a non-empty directory on its class path
    with zipfile.ZipFile(where) as z:
        assert "io/isbflow/hadoop/LocalFileSystem$Raw.class" in z.namelist()
    assert [p.name for p in tmp_path.iterdir()] == [where.name]  # no work directory left behind
    # compiled once: the next SparkSession finds it without a compiler
    assert hadoop_fs.compile_class("/nonexistent/javac", jar, tmp_path) == where
    # a compiler that fails is said, and leaves nothing
    with pytest.raises(RuntimeError, match="failed"):
        hadoop_fs.compile_class("/bin/false", jar, tmp_path / "other")
    assert list((tmp_path / "other").iterdir()) == []


def test_a_users_file_system_or_classpath_is_kept(spark):
    assert local_fs_conf({LOCAL_FS_CONF: "org.apache.hadoop.fs.LocalFileSystem"}) == {}
    # the suite's JVM runs already: it gets the class only because it can load it, no classpath
    assert local_fs_conf({CLASSPATH_CONF: "/x.jar"}) == {LOCAL_FS_CONF: hadoop_fs.CLASS}


def test_the_suites_session_writes_files_through_it_with_the_same_permissions(spark, tmp_path):
    """The session's ``file:`` paths go through isbflow's class, and what it creates has the modes
    Hadoop's gave (umask 077: 0600 files with their ``.crc``, 0700 directories)."""
    jvm = spark.sparkContext._jvm
    conf = spark._jsparkSession.sessionState().newHadoopConf()
    path = jvm.org.apache.hadoop.fs.Path(f"file://{tmp_path / 'd' / 'f'}")
    fs = path.getFileSystem(conf)
    assert fs.getClass().getName() == hadoop_fs.CLASS
    out = fs.create(path, True)
    out.write(b"x")
    out.close()
    assert stat.S_IMODE((tmp_path / "d" / "f").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "d" / ".f.crc").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o700
    spark.range(3).write.parquet(str(tmp_path / "p"))
    assert sorted(r.id for r in spark.read.parquet(str(tmp_path / "p")).collect()) == [0, 1, 2]


CHILD = textwrap.dedent("""
    import sys
    from isbflow.steps.session import spark_session
    spark = spark_session("local[1]", app_name="isbflow-test-hadoop-fs", conf={"spark.ui.enabled": "false"})
    jvm = spark.sparkContext._jvm
    conf = spark._jsparkSession.sessionState().newHadoopConf()
    for name, fs in (("session", jvm.org.apache.hadoop.fs.Path("file:///").getFileSystem(conf)),
                     ("hadoop", jvm.org.apache.hadoop.fs.LocalFileSystem())):
        if name == "hadoop":
            fs.initialize(jvm.java.net.URI("file:///"), conf)
        print(name, fs.getClass().getName(), flush=True)
        for i in range(3):
            out = fs.create(jvm.org.apache.hadoop.fs.Path(f"file://{sys.argv[1]}/{name}/f{i}"), True)
            out.close()
        print(name, "done", flush=True)
    spark.stop()
""")


def test_no_chmod_process_runs_for_a_file_the_session_creates(tmp_path):
    """A JVM whose ``PATH`` starts with a ``chmod`` that logs its calls: files created through the
    session's file system call it never; Hadoop's own class, in the same JVM, calls it for each."""
    fake = tmp_path / "bin"
    fake.mkdir()
    calls = tmp_path / "calls"
    (fake / "chmod").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec /bin/chmod "$@"\n')
    (fake / "chmod").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYSPARK_GATEWAY_PORT", None)
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "session done" in lines and "hadoop done" in lines, done.stdout
    called = calls.read_text().splitlines() if calls.exists() else []
    assert not [c for c in called if "/session/" in c], called
    assert f"session {hadoop_fs.CLASS}" in lines, done.stdout
    # the control: Hadoop's class ran chmod for each file and its .crc (what the test would see otherwise)
    assert len([c for c in called if "/hadoop/" in c]) >= 6, called
