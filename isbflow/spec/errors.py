"""A spec's problems, located: file, field path, message, line and column."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpecProblem:
    """One problem: the file, the path in the document, what is wrong, and where."""

    file: str
    path: str
    message: str
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        at = ""
        if self.line is not None:
            at = f" (line {self.line}" + (f", column {self.column}" if self.column else "") + ")"
        return f"{self.file}: {where}{self.message}{at}"


class SpecError(Exception):
    """One or more problems in spec files; ``str()`` is one line per problem."""

    def __init__(self, problems: Sequence[SpecProblem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))
