"""What provisioning reports: each change with its class, each resource's outcome, drift, server state."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from isbflow.isb.provision_resources import Kind, plain


class ChangeClass(StrEnum):
    """How risky one field change is, judged before anything is applied (see :mod:`isbflow.isb.provision`)."""

    SAFE = "safe"
    MAY_DISCARD = "may-discard"
    RECREATE = "recreate"
    FOREIGN = "foreign"  # the stream's metadata names another owner: never changed, whatever the flags

    @property
    def label(self) -> str:
        return {"safe": "in place, safe", "may-discard": "may discard unread messages",
                "recreate": "needs a recreate", "foreign": "owned by another pipeline or edge"}[self.value]


class Action(StrEnum):
    CREATED = "created"
    UPDATED = "updated"
    UNCHANGED = "unchanged"
    RECREATED = "recreated"
    REFUSED = "refused"  # a change of this resource was refused: nothing in the run was applied
    SKIPPED = "skipped"  # would change, but another resource's change was refused: left as it was


@dataclass(frozen=True)
class FieldChange:
    """One field that differs; ``cls`` and ``reason`` say what applying it would do to the data."""

    field: str
    old: Any
    new: Any
    cls: ChangeClass = ChangeClass.SAFE
    reason: str = ""
    applied: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "old": plain(self.old), "new": plain(self.new), "class": self.cls.value,
                "reason": self.reason, "applied": self.applied}

    def __str__(self) -> str:
        mark = "" if self.cls == ChangeClass.SAFE else f" ({self.cls.label})"
        return f"{self.field}: {plain(self.old)} -> {plain(self.new)}{mark}"


@dataclass
class ResourceResult:
    name: str
    kind: Kind
    action: Action
    changes: list[FieldChange] = field(default_factory=list)
    message: str = ""
    messages: int | None = None  # held by the stream before the run (None: it did not exist)
    unread: int | None = None  # of those, not yet committed by its reader

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "action": self.action.value,
                "changes": [c.to_json() for c in self.changes], "message": self.message,
                "messages": self.messages, "unread": self.unread}


@dataclass
class ProvisionReport:
    pipeline: str
    resources: list[ResourceResult] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """True when the server was modified (created, updated or recreated anything)."""
        return any(r.action in (Action.CREATED, Action.UPDATED, Action.RECREATED) for r in self.resources)

    @property
    def refused(self) -> list[ResourceResult]:
        return [r for r in self.resources if r.action == Action.REFUSED]

    @property
    def pending(self) -> list[ResourceResult]:
        """Resources still differing from the spec after the run (a refused run: every one it
        would have changed)."""
        return [r for r in self.resources if r.action in (Action.REFUSED, Action.SKIPPED)]

    def to_json(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "changed": self.changed, "pending": len(self.pending),
                "refused": len(self.refused), "resources": [r.to_json() for r in self.resources]}


@dataclass(frozen=True)
class Drift:
    """One difference between spec and server; ``field == "exists"`` for a missing resource.

    ``cls`` is the class the change would have if applied now (:class:`ChangeClass`),
    ``unread`` the messages the stream holds that its reader has not committed.
    """

    resource: str
    kind: Kind
    field: str
    spec: Any
    server: Any
    cls: ChangeClass = ChangeClass.SAFE
    unread: int | None = None
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"resource": self.resource, "kind": self.kind, "field": self.field,
                "spec": plain(self.spec), "server": plain(self.server), "class": self.cls.value,
                "unread": self.unread, "reason": self.reason}


@dataclass(frozen=True)
class ReplicaHealth:
    name: str | None
    current: bool | None
    offline: bool | None
    lag: int | None
    active: float | None  # seconds since the peer was last seen


@dataclass
class StreamStatus:
    """Server state of one resource; ``exists`` False when it is missing (numbers then 0).

    ``config`` is the server's own configuration of the stream, in JetStream's names:
    retention, storage, max_msgs, max_bytes, max_age (s), discard, num_replicas,
    duplicate_window (s), max_msg_size (empty when missing).
    """

    name: str
    kind: Kind
    exists: bool
    messages: int = 0
    bytes: int = 0
    first_seq: int = 0
    last_seq: int = 0
    consumer_count: int = 0
    replicas: int = 0
    leader: str | None = None
    peers: list[ReplicaHealth] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def values(self) -> int | None:
        """For a KV bucket: values stored (history included), as ``nats kv status`` counts."""
        return self.messages if self.kind == "kv" else None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["values"] = self.values
        d["config"] = {k: plain(v) for k, v in self.config.items()}
        return d
