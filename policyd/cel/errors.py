"""The two errors the CEL layer raises; nothing else escapes it."""

from __future__ import annotations


class CelCompileError(Exception):
    """An expression that cannot be loaded: syntax, type, undeclared name, cost.

    ``line`` and ``column`` are 1-based positions inside the expression source,
    so the policy loader can add the expression's own place in its file.
    """

    def __init__(self, message: str, line: int = 1, column: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.column = column

    def __str__(self) -> str:
        return f"{self.line}:{self.column}: {self.message}"


class CelEvalError(Exception):
    """A CEL runtime error (division by zero, missing map key, overflow, ...).

    It is a *value* in CEL terms: ``&&``/``||`` may absorb it. When it reaches
    the caller, the expression as a whole evaluated to an error. Compiled
    programs hold errors as instances of exactly this class (never a subclass),
    which is how they tell an error value from an ordinary one.
    """
