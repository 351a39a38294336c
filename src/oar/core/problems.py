"""What a check before the work finds: one line per problem, naming where and what to do
(:class:`Problem`), raised together (:func:`require`, :class:`PreflightError`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["Problem", "PreflightError", "require"]


@dataclass(frozen=True)
class Problem:
    """One thing that would fail later: where it is (``source``, ``key``) and what to do (``message``)."""

    source: str
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.source}: {self.key}: {self.message}"


class PreflightError(ValueError):
    """Problems found before anything runs; the message is one line per problem."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


def require(problems: Iterable[Problem]) -> None:
    """Raise :class:`PreflightError` when there is any problem."""
    problems = list(problems)
    if problems:
        raise PreflightError(problems)
