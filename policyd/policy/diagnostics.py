"""The one place policy loading reports problems: ``file:line:col: message``.

Loading never stops at the first mistake: every check adds a ``Diagnostic`` to
a list, so ``policyd check`` shows an operator all of them at once. Warnings
(an unreachable node, an unused param) are reported but do not reject a file.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Severity = Literal["error", "warning"]


@dataclass(frozen=True, slots=True, order=True)
class Diagnostic:
    """One problem at one place; positions are 1-based."""

    path: str
    line: int
    column: int
    message: str
    severity: Severity = "error"

    def __str__(self) -> str:
        label = "warning: " if self.severity == "warning" else ""
        return f"{self.path}:{self.line}:{self.column}: {label}{self.message}"


class PolicyError(Exception):
    """A policy (or policy test) file that cannot be loaded, with every reason."""

    def __init__(self, diagnostics: Iterable[Diagnostic]) -> None:
        self.diagnostics = tuple(sorted(diagnostics))
        super().__init__("\n".join(str(d) for d in self.diagnostics))

    @property
    def errors(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.diagnostics if d.severity == "error")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """A ``; did you mean 'x'?`` suffix for a misspelt name, or nothing."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""
