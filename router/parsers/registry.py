"""The one registry of parsers by name, for every kind of output parser (tool calls:
router/parsers/tools/, reasoning: router/parsers/reasoning/), as vLLM selects them
(`--tool-call-parser NAME`, `--reasoning-parser NAME`).

A class registers itself with `@registry.register(name)` (built-ins on import, a plugin file
when loaded: `load_plugin`); a second class for a name replaces the first, so a plugin may
override a built-in. `get(name)` is the class, or a ValueError listing the known names.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable, Generic, TypeVar

P = TypeVar("P", bound=type)


class ParserRegistry(Generic[P]):
    def __init__(self, kind: str, plugin_flag: str) -> None:
        self.kind = kind  # "tool call", "reasoning": in error messages
        self.plugin_flag = plugin_flag
        self._classes: dict[str, P] = {}

    def register(self, name: str) -> Callable[[P], P]:
        """Class decorator: `name` selects the class (whose `name` it sets)."""

        def add(cls: P) -> P:
            setattr(cls, "name", name)
            self._classes[name] = cls
            return cls

        return add

    def get(self, name: str) -> P:
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} parser {name!r} (known: {', '.join(sorted(self._classes))})"
            ) from None

    def remove(self, name: str) -> None:
        """Forgets `name` (no error if unknown)."""
        self._classes.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._classes)

    def load_plugin(self, path: str) -> None:
        """Imports a Python file whose classes register themselves."""
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"{self.plugin_flag} {path}: no such file")
        spec = importlib.util.spec_from_file_location(f"pdserve_plugin_{file.stem}", file)
        if spec is None or spec.loader is None:
            raise ValueError(f"{self.plugin_flag} {path}: not a Python file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
