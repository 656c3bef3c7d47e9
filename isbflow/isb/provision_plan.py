"""Classify every change before anything is applied (the first half of :func:`isbflow.isb.provision.apply`).

Each field that differs between spec and server gets one class (:class:`ChangeClass`),
judged against what the stream holds *now* (:class:`Holding`):

- ``recreate`` (*needs a recreate*): ``storage`` and ``retention``; JetStream cannot
  change them in place (nats-server 2.15.1: "can not change storage type", "can not
  change retention policy to/from workqueue"; Limits -> Interest is accepted in place
  but drops every message without a consumer), so the stream is deleted and created
  again and loses what it holds.
- ``may-discard`` (*may discard unread messages*), only when the stream holds unread
  messages:

  - ``max_msgs`` lowered below the unread count while the discard policy (after the
    change) is ``old``: the server drops the oldest at once;
  - ``max_bytes`` lowered below the bytes held, discard ``old``;
  - ``max_age`` lowered below the age of the oldest unread message: it expires at once,
    whatever the discard policy;
  - ``discard`` ``new`` -> ``old`` on a bounded stream (e.g. retention WorkQueue -> Limits):
    a full buffer then drops its oldest unread messages instead of refusing new ones;
  - a KV bucket's history (``max_msgs_per_subject``) lowered while it holds values.

  With discard ``new`` a lowered ``max_msgs``/``max_bytes`` keeps every message (checked on
  nats-server 2.15.1): producers see back-pressure until readers catch up, so it is safe.
- ``safe`` (*in place, safe*): everything else (replicas, duplicates window, max_msg_size,
  subjects, description, metadata, raised limits, discard ``old`` -> ``new``).

*Owner*: every stream isbflow creates carries metadata naming its owner (``isbflow.pipeline``,
``isbflow.role``, and ``isbflow.edge``/``isbflow.partition`` or ``isbflow.vertex``). A stream
whose metadata names another owner (two specs that derive the same name, loaded apart) is
*foreign* (:func:`foreign_owner`): no flag lets a run update, recreate or delete it. A stream
without owner metadata (created by an older isbflow) is adopted.

*Unread* messages: for a WorkQueue or Interest stream, every message it holds (isbflow
purges what was committed downstream); for a Limits stream read by a vertex, the
messages above the sequence that vertex committed (status bucket key
``committed.<vertex>.<stream>``; every message when none is recorded); for the
dead-letter stream and KV buckets, everything they hold.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nats.errors import Error as NatsError
from nats.js.api import StreamConfig, StreamInfo

from isbflow.isb import naming
from isbflow.isb.provision_report import Action, ChangeClass, FieldChange, ResourceResult
from isbflow.isb.provision_resources import (
    HASH_KEY,
    IMMUTABLE_FIELDS,
    META_PREFIX,
    Resource,
    plain,
    same,
)
from isbflow.isb.state import committed_key

if TYPE_CHECKING:
    from nats.js import JetStreamContext


@dataclass(frozen=True)
class Holding:
    """What a stream holds now: messages and bytes, how many are unread, and the age in seconds
    of the oldest unread one (None when not asked for or there is none)."""

    messages: int = 0
    bytes: int = 0
    unread: int = 0
    oldest_unread_age: float | None = None


#: metadata keys that name a stream's owner, compared key by key when both sides have one
OWNER_KEYS = ("isbflow.pipeline", "isbflow.role", "isbflow.vertex", "isbflow.edge", "isbflow.partition")


def owner_text(labels: dict[str, str]) -> str:
    """Who ``labels`` name as owner, in words (``pipeline p, buffer a->b partition 0``)."""
    out = f"pipeline {labels.get('isbflow.pipeline', '?')}"
    role = labels.get("isbflow.role")
    if "isbflow.edge" in labels:
        out += f", buffer {labels['isbflow.edge']} partition {labels.get('isbflow.partition', '?')}"
    elif "isbflow.vertex" in labels:
        out += f", {role or 'vertex'} {labels['isbflow.vertex']}"
    elif role:
        out += f", {role}"
    return out


def foreign_owner(r: Resource, metadata: dict[str, str] | None) -> str:
    """The owner a stream's ``metadata`` names when it is not ``r``'s; "" when it is ``r``'s or
    names nobody (a stream from an older isbflow, adopted)."""
    meta = metadata or {}
    if any(k in meta and k in r.labels and meta[k] != r.labels[k] for k in OWNER_KEYS):
        return owner_text(meta)
    return ""


def _tightened(have: Any, want: Any) -> bool:
    """A limit (``-1``/``0`` = unlimited) that becomes stricter."""
    return want is not None and want > 0 and (have is None or have <= 0 or want < have)


def classify_field(r: Resource, name: str, have: Any, want: Any, holding: Holding) -> tuple[ChangeClass, str]:
    """The class of changing ``name`` from ``have`` to ``want`` on ``r`` holding ``holding``, and why."""
    if name in IMMUTABLE_FIELDS:
        lost = f": the stream's {holding.messages} message(s) are lost" if holding.messages else ""
        return ChangeClass.RECREATE, f"JetStream cannot change {name} in place; delete and create again{lost}"
    n = holding.unread
    if r.kind == "kv":
        if name == "max_msgs_per_subject" and _tightened(have, want) and holding.messages > 0:
            return ChangeClass.MAY_DISCARD, f"keeps {want} value(s) per key: older values go at once"
        return ChangeClass.SAFE, ""
    discard_old = plain(r.fields.get("discard")) == "old"
    if name == "max_msgs" and discard_old and _tightened(have, want) and n > want:
        return ChangeClass.MAY_DISCARD, f"{n} unread message(s) above the limit: the oldest {n - want} go at once"
    if name == "max_bytes" and discard_old and _tightened(have, want) and n > 0 and holding.bytes > want:
        return ChangeClass.MAY_DISCARD, (f"holds {holding.bytes} bytes: the oldest messages go at once, "
                                         "unread ones among them")
    if name == "max_age" and _tightened(have, want) and holding.oldest_unread_age is not None \
            and holding.oldest_unread_age > want:
        age = holding.oldest_unread_age
        shown = "unknown age" if math.isinf(age) else f"{age:.0f}s old"
        return ChangeClass.MAY_DISCARD, f"the oldest unread message is {shown}: it expires at once"
    bounded = (r.fields.get("max_msgs") or -1) > 0 or (r.fields.get("max_bytes") or -1) > 0
    if name == "discard" and plain(want) == "old" and plain(have) == "new" and bounded and n > 0:
        return ChangeClass.MAY_DISCARD, ("a full buffer would drop its oldest unread messages instead of "
                                         "refusing new ones (back-pressure)")
    return ChangeClass.SAFE, ""


def compare(r: Resource, config: StreamConfig, holding: Holding) -> tuple[list[FieldChange], FieldChange | None]:
    """The classified field differences and a metadata difference, if any."""
    changes = []
    for name, want in r.fields.items():
        have = getattr(config, name)
        if not same(name, have, want):
            cls, reason = classify_field(r, name, have, want, holding)
            changes.append(FieldChange(name, have, want, cls, reason))
    want_meta = r.metadata()
    have_meta = {k: v for k, v in (config.metadata or {}).items() if k.startswith(META_PREFIX)}
    meta = None
    if have_meta != want_meta:
        meta = FieldChange("metadata", have_meta.get(HASH_KEY), want_meta[HASH_KEY])
    return changes, meta


@dataclass
class ResourcePlan:
    """What applying the spec would do to one resource, decided before anything is applied."""

    resource: Resource
    info: StreamInfo | None
    changes: list[FieldChange] = field(default_factory=list)
    meta: FieldChange | None = None
    holding: Holding = field(default_factory=Holding)
    refusal: str = ""  # why this resource's changes may not be applied ("" when they may)
    owner: str = ""  # the other owner the server's stream names (:func:`foreign_owner`), "" when ours

    @property
    def exists(self) -> bool:
        return self.info is not None

    @property
    def needs_recreate(self) -> bool:
        return any(c.cls == ChangeClass.RECREATE for c in self.changes)

    @property
    def action(self) -> Action:
        """What applying does (when the run is not refused)."""
        if not self.exists:
            return Action.CREATED
        if not self.resource.managed:
            return Action.UNCHANGED
        if self.owner:
            return Action.REFUSED
        if self.needs_recreate:
            return Action.RECREATED
        return Action.UPDATED if self.changes or self.meta is not None else Action.UNCHANGED

    def decide(self, recreate: bool, force: bool) -> None:
        """Set :attr:`refusal`: a recreate needs ``recreate`` (and ``force`` when the stream holds
        messages); a change that may discard unread messages needs ``force``."""
        self.refusal = ""
        if not self.exists or not self.resource.managed:
            return
        if self.owner:
            self.refusal = ("its metadata names another owner: isbflow never updates, recreates or deletes "
                            "another owner's stream, whatever the flags; two specs derive this name: validate "
                            "them together (isbflow validate -f A -f B) and rename one")
            return
        held, unread = self.holding.messages, self.holding.unread
        if self.needs_recreate:
            fields = ", ".join(c.field for c in self.changes if c.cls == ChangeClass.RECREATE)
            if not recreate:
                more = f" --force (drops its {held} message(s), {unread} unread)" if held else ""
                self.refusal = f"{fields} cannot change in place: re-run with --recreate{more}"
            elif held and not force:
                self.refusal = (f"a recreate drops its {held} message(s), {unread} unread: drain the pipeline "
                                "first, or add --force to drop them")
        elif any(c.cls == ChangeClass.MAY_DISCARD for c in self.changes) and not force:
            self.refusal = (f"may discard some of its {unread} unread message(s): drain the pipeline first, "
                            "or pass --force to apply anyway")

    def result(self, action: Action | None = None, applied: bool = False, message: str = "") -> ResourceResult:
        r = self.resource
        shown = self.changes if self.changes else ([self.meta] if self.meta is not None else [])
        if applied:
            shown = [FieldChange(c.field, c.old, c.new, c.cls, c.reason, applied=True) for c in shown]
        return ResourceResult(r.name, r.kind, action or self.action, shown, message,
                              self.holding.messages if self.exists else None,
                              self.holding.unread if self.exists else None)

    def refusal_lines(self) -> list[str]:
        """One line per refused change: stream, field, old -> new, class, unread count, why."""
        name, unread = self.resource.name, self.holding.unread
        if self.owner:
            return [f"{name}: owned by {self.owner}, not by {owner_text(self.resource.labels)}: "
                    f"{ChangeClass.FOREIGN.label}, {self.holding.messages} message(s)"]
        risky = [c for c in self.changes if c.cls != ChangeClass.SAFE]
        return [f"{name}: {c.field} {plain(c.old)} -> {plain(c.new)}: {c.cls.label}, {unread} unread "
                f"message(s){f' ({c.reason})' if c.reason else ''}" for c in risky]


async def _committed(js: JetStreamContext, r: Resource) -> int | None:
    """The sequence ``r``'s reader committed (status bucket), None when unknown."""
    pipeline = r.labels.get("isbflow.pipeline")
    if r.reader is None or pipeline is None:
        return None
    try:
        kv = await js.key_value(naming.status_bucket(pipeline))
        entry = await kv.get(committed_key(r.reader, r.stream))
    except (NatsError, ValueError):  # no bucket, no key
        return None
    try:
        return int(entry.value) if entry.value else None
    except ValueError:
        return None


async def holding(js: JetStreamContext, r: Resource, info: StreamInfo, need_age: bool) -> Holding:
    """What ``r`` holds now (see the module docstring for *unread*)."""
    st = info.state
    unread, first_unread = st.messages, st.first_seq
    if r.kind == "stream" and plain(info.config.retention) == "limits" and st.messages:
        committed = await _committed(js, r)
        if committed is not None:
            first_unread = max(st.first_seq, committed + 1)
            unread = 0 if first_unread > st.last_seq else min(st.messages, st.last_seq - first_unread + 1)
    age = None
    if need_age and unread > 0:
        try:
            msg = await js.get_msg(r.stream, seq=first_unread, subject=">", next=True)
            age = max(0.0, time.time() - msg.time.timestamp()) if msg.time else math.inf
        except NatsError:
            age = math.inf  # unknown: judged as old as can be
    return Holding(st.messages, st.bytes, unread, age)


def needs_age(r: Resource, config: StreamConfig) -> bool:
    """Whether classifying ``r`` against ``config`` needs the age of the oldest unread message."""
    return r.kind == "stream" and _tightened(config.max_age, r.fields.get("max_age"))


def refusal_message(plans: list[ResourcePlan]) -> str:
    """The error of a refused run: what was refused, line by line, and how to proceed."""
    refused = [p for p in plans if p.refusal]
    lines = [f"refused, nothing was applied: {len(refused)} resource(s) hold data a change could lose, "
             "need a recreate or belong to another owner"]
    for p in refused:
        lines.extend(f"  {line}" for line in p.refusal_lines())
        lines.append(f"    -> {p.refusal}")
    return "\n".join(lines)
