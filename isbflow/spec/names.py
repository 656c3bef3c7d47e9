"""Names and roles shared by the spec's models and its graph rules."""

from __future__ import annotations

# Names end up in stream names, subjects, paths and command lines: keep them to a safe alphabet so
# no spec value can inject arguments or leave a folder. ``\Z``, not ``$``: ``$`` also matches
# before a final newline.
NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,46}[a-z0-9])?\Z"

#: what a vertex is: exactly one of these
VERTEX_ROLES = ("source", "udf", "sink")
