"""The worker extension (vLLM's `worker_extension_cls`) and `collective_rpc` over it: a method
is looked up on the extension first, then on the engine."""

from __future__ import annotations

import importlib
from typing import Any


def load_extension(spec: str | None, engine: Any) -> Any:
    """`module:Class` built as Class(engine), or None."""
    if not spec:
        return None
    module, _, cls = spec.partition(":")
    return getattr(importlib.import_module(module), cls)(engine)


def collective_rpc(
    extension: Any, engine: Any, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None
) -> list:
    """Call `method` on `extension` if it has it, else on `engine`; the list of results (one
    per engine: one offline, one per worker in a cluster). ValueError for no such public
    method."""
    has = extension is not None and hasattr(extension, method)
    fn = getattr(extension if has else engine, method, None)
    if fn is None or method.startswith("_"):
        raise ValueError(f"collective_rpc: no method {method!r} on the engine or its extension")
    return [fn(*args, **(kwargs or {}))]
