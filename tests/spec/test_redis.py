"""``spec.redis`` in Numaflow's vocabulary: ``native`` (isbflow starts redis-server) or ``external`` (a URL),
one store per service, and every field with no meaning on one machine refused, located by file, field and line."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from isbflow.spec import SpecError, load_specs
from isbflow.spec.isbsvc import redis_directives
from isbflow.spec.numaflow import REDIS_SETTINGS, REDIS_SETTINGS_REFUSED


def service(tmp_path: Path, spec: str, name: str = "default") -> Path:
    """A file holding one ISB service whose ``spec`` is the YAML given (indented 2)."""
    f = tmp_path / "isbsvc.yaml"
    f.write_text(f"apiVersion: numaflow.numaproj.io/v1alpha1\nkind: InterStepBufferService\nmetadata:\n  name: {name}\n"
                 "spec:\n" + textwrap.indent(textwrap.dedent(spec), "  "))
    return f


def problem(path: Path):
    with pytest.raises(SpecError) as e:
        load_specs(path)
    assert len(e.value.problems) == 1, "\n".join(map(str, e.value.problems))
    return e.value.problems[0]


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_native_redis_with_numaflows_settings_string(tmp_path):
    f = service(tmp_path, """\
        redis:
          native:
            persistence: true
            fsync: always
            settings:
              redis: |
                # Numaflow writes redis.conf lines here
                maxmemory 2gb
                stream-node-max-entries "200"
        """)
    svc = load_specs(f).services["default"]
    assert svc.store == svc.spec.store == "redis"
    native = svc.spec.redis.native
    assert (native.persistence, native.fsync) == (True, "always")
    assert native.settings.directives == [("maxmemory", "2gb"), ("stream-node-max-entries", "200")]
    assert svc.spec.redis.external is None


def test_native_defaults_and_external_with_a_password_file(tmp_path):
    native = load_specs(service(tmp_path, "redis:\n  native: {}\n")).services["default"].spec.redis.native
    assert (native.persistence, native.fsync, native.settings.directives) == (True, "everysec", [])
    f = service(tmp_path, """\
        redis:
          external:
            url: redis://10.0.0.5:6379/0
            user: isbflow
            password:
              file: redis.password
        """)
    ext = load_specs(f).services["default"].spec.redis.external
    assert (ext.url, ext.user, ext.password.file, ext.password.connectionId) == (
        "redis://10.0.0.5:6379/0", "isbflow", "redis.password", None)
    for url in ("10.0.0.5:6379", "rediss://cache.example.com:6380", "redis://[::1]:6379"):
        assert load_specs(service(tmp_path, f"redis:\n  external:\n    url: {url}\n")).services["default"].store == "redis"


def test_neither_store_is_jetstream_with_defaults(tmp_path):
    svc = load_specs(service(tmp_path, "{}\n")).services["default"]
    assert svc.store == "jetstream" and svc.spec.redis is None and svc.spec.jetstream.url == "embedded"


@pytest.mark.parametrize("spec,path,anchor,words", [
    ("jetstream:\n  url: embedded\nredis:\n  native: {}\n", "jetstream", "jetstream:",
     ["jetstream and redis are both set", "one store"]),
    ("redis:\n  native: {}\n  external:\n    url: h:6379\n", "redis.external", "external:",
     ["native and external are both set"]),
    ("redis: {}\n", "redis", "redis:", ["set native", "external"]),
    ("redis:\n  native:\n    encryption: true\n", "redis.native.encryption", "encryption:",
     ["Redis has no encryption at rest", "encrypted volume"]),
    ("redis:\n  external:\n    url: h:6379\n    encryption: true\n", "redis.external.encryption", "encryption:",
     ["no encryption at rest"]),
    ("redis:\n  native:\n    settings:\n      redis: |\n        maxmemory 1gb\n        bind 0.0.0.0\n",
     "redis.native.settings.redis", "redis: |", ["line 2 of the string", "bind is refused", "127.0.0.1 only"]),
    ("redis:\n  native:\n    settings:\n      redis: |\n        requirepass hunter2\n",
     "redis.native.settings.redis", "redis: |", ["requirepass is refused", "credentials never sit in a spec"]),
    ("redis:\n  native:\n    settings:\n      redis: |\n        PORT 7000\n",
     "redis.native.settings.redis", "redis: |", ["port is refused"]),
    ("redis:\n  native:\n    settings:\n      redis: |\n        protected-mode no\n",
     "redis.native.settings.redis", "redis: |", ["protected-mode is refused"]),
    ("redis:\n  native:\n    settings:\n      redis: |\n        rename-command FLUSHALL \"\"\n",
     "redis.native.settings.redis", "redis: |", ["rename-command is refused", "ACLs call commands by name"]),
    ("redis:\n  native:\n    settings:\n      redis: |\n        maxmemory-policy allkeys-lru\n",
     "redis.native.settings.redis", "redis: |", ["must stay noeviction"]),
    ("redis:\n  native:\n    settings:\n      redis: |\n        tls-port 6380\n",
     "redis.native.settings.redis", "redis: |", ["tls-port is refused"]),
    ("redis:\n  native:\n    settings:\n      redis: |\n        appendonly no\n",
     "redis.native.settings.redis", "redis: |", ["redis.native.persistence"]),
    ("redis:\n  native:\n    settings:\n      redis: |\n        frobnicate 1\n",
     "redis.native.settings.redis", "redis: |", ["not a setting isbflow passes", "allowed: maxmemory"]),
    ("redis:\n  native:\n    settings:\n      redis: |\n        hz 10\n        hz 20\n",
     "redis.native.settings.redis", "redis: |", ["hz is set twice"]),
    ("redis:\n  native:\n    persistence:\n      volumeSize: 10Gi\n", "redis.native.persistence", "persistence:",
     ["Kubernetes volume", "<data dir>/redis"]),
    ("redis:\n  native:\n    persistence: false\n    fsync: always\n", "redis.native", "native:",
     ["fsync is set but persistence is false"]),
    ("redis:\n  native:\n    replicas: 3\n", "redis.native.replicas", "replicas:", ["one redis-server", "no Sentinel"]),
    ("redis:\n  native:\n    version: 7.0.11\n", "redis.native.version", "version:", ["scripts/ensure-redis"]),
    ("redis:\n  native:\n    redisContainerTemplate: {}\n", "redis.native.redisContainerTemplate",
     "redisContainerTemplate:", ["no pods to template"]),
    ("redis:\n  native:\n    affinity: {}\n", "redis.native.affinity", "affinity:", ["not as Kubernetes objects"]),
    ("redis:\n  native:\n    settings:\n      sentinel: |\n        x 1\n", "redis.native.settings.sentinel",
     "sentinel:", ["no Sentinel"]),
    ("redis:\n  external:\n    url: h:6379\n    masterName: mymaster\n", "redis.external.masterName",
     "masterName:", ["Sentinel discovery is not supported"]),
    ("redis:\n  external:\n    url: redis://isb:s3cret@h:6379\n", "redis.external.url", "url:",
     ["credentials do not go in the url"]),
    ("redis:\n  external:\n    url: http://h:6379\n", "redis.external.url", "url:", ["is not a Redis address"]),
    ("redis:\n  external:\n    url: h:70000\n", "redis.external.url", "url:", ["is not a Redis address"]),
    ("redis:\n  external:\n    url: h:6379\n    password:\n      name: redis-secret\n",
     "redis.external.password.name", "name: redis-secret", ["Kubernetes secret selector", "password.file"]),
    ("redis:\n  external:\n    url: h:6379\n    password: {}\n", "redis.external.password", "password:",
     ["set one of file", "connectionId"]),
])
def test_refused_with_the_reason_and_located(tmp_path, spec, path, anchor, words):
    f = service(tmp_path, spec)
    p = problem(f)
    assert p.file == str(f) and p.path == path, str(p)
    assert all(w in p.message for w in words), str(p)
    assert p.line == line_of(f, anchor), str(p)
    assert "s3cret" not in str(p)


def test_a_pipeline_may_name_a_redis_service(tmp_path):
    """The spec loads (isbflow isb up starts its store); running the pipeline is what is refused (ops)."""
    f = service(tmp_path, "redis:\n  native: {}\n", name="redis-isbs")
    f.write_text(f.read_text() + textwrap.dedent("""\
        ---
        kind: Pipeline
        metadata:
          name: p
        spec:
          interStepBufferServiceName: redis-isbs
          vertices:
            - name: in
              source:
                jetstream:
                  subject: a.b
            - name: out
              sink:
                delta:
                  path: out
          edges:
            - from: in
              to: out
        """))
    specs = load_specs(f)
    assert specs.service_for(specs.pipelines["p"]).store == "redis"


def test_the_settings_tables_do_not_overlap_and_each_refusal_says_why():
    assert not [s for s in REDIS_SETTINGS
                if any(s == k or (k.endswith("-") and s.startswith(k)) for k in REDIS_SETTINGS_REFUSED)]
    assert all(len(why) > 20 for why in REDIS_SETTINGS_REFUSED.values())
    assert redis_directives("\n# only a comment\n\n") == []
    with pytest.raises(ValueError, match="control characters"):
        redis_directives('maxmemory "1gb\x07"')
