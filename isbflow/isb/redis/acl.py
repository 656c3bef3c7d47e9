"""Who may do what on the Redis store: one ACL user per role, each with the least it needs.

The users mirror the NATS roles of :mod:`isbflow.isb.roles`, from the same grants
(:class:`isbflow.isb.roles.PipelineGrant`):

=================  ==============================================================
user               may
=================  ==============================================================
``default``        everything (the admin, ``requirepass``: provisioning, recovery, the platform)
``producer``       write frames into the granted pipelines' source streams (the write script
                   and the commands it runs); read nothing
``reader``         read, never write, every granted pipeline's streams' state and ranges and its
                   control, status and ledger buckets: what the UI shows (read commands only, so
                   no script it runs can write either)
``pipeline-<p>``   what pipeline ``p``'s drivers need on ``p``'s own streams only (its edge
                   partitions, source streams and dead letters): write, read ranges, wait for appends, release,
                   check for loss; read and write ``p``'s control, status and ledger buckets
                   (:mod:`isbflow.isb.redis.kv`); read the reference-table buckets its grant
                   lists (``PipelineGrant.references``); nothing of another pipeline
=================  ==============================================================

A user's keys are listed one by one (``~isbflow:{<stream>}`` and its ``:ids`` and ``:inc``,
``~isbflow:kv:{<bucket>}``, :mod:`isbflow.isb.redis.keys`), never a prefix pattern: pipeline names
may contain ``-``, so ``isb-a-*`` would also match pipeline ``a-b``'s streams. Reference tables
are read only (``%R~``: Redis refuses a write command on the key whatever the user's commands);
they are loaded by the admin. A reference table the grant does not list is the admin's alone. No
role but the admin has ``FLUSHALL``, ``CONFIG``, ``KEYS``, ``ACL``, ``SCRIPT`` or ``DEBUG``. Redis
checks every command a script runs against the caller's ACL, so ``EVAL`` grants nothing beyond the
commands listed here.

Passwords are generated into owner-only files, ``<data dir>/redis/<user>.password``, as the NATS
roles' are; ``users.conf`` (included by the server's config) holds the users with their
passwords' SHA-256 only, so they survive a restart.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from isbflow.isb import naming, roles
from isbflow.isb.redis.keys import BufferKeys, kv_key
from isbflow.isb.redis.server import USERS_FILE, redis_dir, secret, write_private

ADMIN = "default"
PRODUCER = roles.PRODUCER
READER = roles.READER
pipeline_user = roles.pipeline_user

#: what the write script (:data:`isbflow.isb.redis.scripts.WRITE`) runs, and how it is called
WRITE_COMMANDS = ("ping", "eval", "evalsha", "time", "exists", "hget", "hset", "xlen", "xadd", "zscore", "zadd")
#: the key-value buckets' commands (:class:`isbflow.isb.redis.kv.RedisKeyValue`, and reading a whole bucket)
KV_COMMANDS = ("hget", "hset", "hdel", "hkeys", "hincrby", "hgetall")
#: what reads a stream's state and ranges (the state and read scripts) and a whole bucket
READ_COMMANDS = ("ping", "eval", "evalsha", "exists", "xinfo|stream", "xlen", "xrange", "hget", "hgetall", "hkeys",
                 "zcard")
#: a pipeline's drivers: writing, the read, release, state and create scripts, and its buckets
PIPELINE_COMMANDS = tuple(dict.fromkeys((*WRITE_COMMANDS, *KV_COMMANDS, "xrange", "xread", "xtrim", "xinfo|stream",
                                         "zremrangebyscore", "zcard")))


def password_file(data_dir: Path | str, user: str) -> Path:
    """Where a role user's password is kept (owner-only); the admin's is the server's ``password``."""
    return redis_dir(data_dir) / ("password" if user == ADMIN else f"{user}.password")


def _glob_escaped(key: str) -> str:
    """``key`` as an ACL key pattern matching itself only."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", key)


def key_patterns(streams: Iterable[str]) -> list[str]:
    """The ``~`` rules granting exactly the keys of ``streams``."""
    return [f"~{_glob_escaped(k)}" for s in dict.fromkeys(streams) for k in BufferKeys(s).all]


def bucket_patterns(buckets: Iterable[str], *, read_only: bool = False) -> list[str]:
    """The rules granting exactly the hashes of key-value ``buckets``: ``~`` (read and write) or,
    ``read_only``, ``%R~``."""
    rule = "%R~" if read_only else "~"
    return [f"{rule}{_glob_escaped(kv_key(b))}" for b in dict.fromkeys(buckets)]


def pipeline_buckets(pipeline: str) -> list[str]:
    """The buckets a pipeline's drivers read and write: its control, status and ledger."""
    return [naming.control_bucket(pipeline), naming.status_bucket(pipeline), naming.ledger_bucket(pipeline)]


def role_grants(grants: Sequence[roles.PipelineGrant]) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    """Every role user: (its key rules, its commands)."""
    out = {PRODUCER: (key_patterns(s for g in grants for s in g.sources), WRITE_COMMANDS),
           # ``~``, not ``%R~``: Redis takes EVAL's keys as written to; the commands are what keep it read-only
           READER: ([*key_patterns(s for g in grants for s in [*g.buffers, *g.sources, g.dlq]),
                     *bucket_patterns(b for g in grants for b in pipeline_buckets(g.pipeline))], READ_COMMANDS)}
    for g in grants:
        keys = [*key_patterns([*g.buffers, *g.sources, g.dlq]), *bucket_patterns(pipeline_buckets(g.pipeline)),
                *bucket_patterns(g.references, read_only=True)]
        out[pipeline_user(g.pipeline)] = (keys, PIPELINE_COMMANDS)
    return out


def user_rules(password: str, keys: Iterable[str], commands: Iterable[str]) -> list[str]:
    """The ACL rules of one role user: only its password, key rules and commands, no channels."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    return ["reset", "on", f"#{digest}", *keys, "resetchannels", "-@all", *(f"+{c}" for c in commands)]


async def apply_users(client: Any, data_dir: Path | str, grants: Sequence[roles.PipelineGrant]) -> list[str]:
    """Make the role users of ``grants`` exactly the server's, through the admin's ``client``: each
    gets its rules (``ACL SETUSER``; a user granted again gets the rules of its current grants), a
    pipeline user of a pipeline no longer in ``grants`` is removed (``ACL DELUSER``), and
    ``users.conf`` holds the same for the next start. Returns the users."""
    wanted = role_grants(grants)
    lines = []
    for user, (keys, commands) in wanted.items():
        rules = user_rules(secret(password_file(data_dir, user)), keys, commands)
        await client.execute_command("ACL", "SETUSER", user, *rules)
        lines.append(" ".join(["user", user, *rules]))
    for user in await client.execute_command("ACL", "USERS"):
        name = user.decode() if isinstance(user, bytes) else str(user)
        if name.startswith(pipeline_user("")) and name not in wanted:
            await client.execute_command("ACL", "DELUSER", name)
    write_private(redis_dir(data_dir) / USERS_FILE, "\n".join(lines) + "\n")
    return list(wanted)
