"""Range checks of frozen configuration and request dataclasses, one way for every layer:
`check_fields(self, [(ok, field, rule), ...])` in `__post_init__` raises a `FieldError` naming
the first field whose rule fails, e.g. `top_p must be in (0, 1], got 1.5`."""

from __future__ import annotations

from typing import Iterable

Rule = tuple[bool, str, str]
"""(whether the rule holds, the field's name, the rule as text: "must be >= 1")."""


class FieldError(ValueError):
    """A field out of its range. `field` names it (callers map it to their own parameter
    names, never by parsing the message); the message reads `<field> <rule>, got <value>`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_fields(obj: object, rules: Iterable[Rule]) -> None:
    """Raise `FieldError` for the first rule that does not hold, quoting `obj`'s value."""
    for ok, field, rule in rules:
        if not ok:
            raise FieldError(field, f"{field} {rule}, got {getattr(obj, field)!r}")
