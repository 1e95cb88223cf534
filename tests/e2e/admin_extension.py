"""A worker extension (vLLM's `--worker-extension-cls`) for the e2e tests: what an operator's
extension looks like, and the one way a test reaches inside a worker's engine over the
network (`CollectiveRPC` calls only an extension's methods). The worker processes import it
through PYTHONPATH (`EXTENSION_PATH`)."""

from __future__ import annotations

from pathlib import Path

import torch

EXTENSION_PATH = str(Path(__file__).resolve().parent)
SPEC = "admin_extension:AdminExtension"


class AdminExtension:
    def __init__(self, engine) -> None:
        self.engine = engine

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def break_kv_pool(self) -> None:
        """Free the KV pool behind the worker's back: the next step that writes KV raises
        (what `CollectiveRPC("sleep")` did before collective_rpc was confined to extensions)."""
        pool = self.engine.kv_cache
        pool.set_(torch.empty(0, dtype=pool.dtype, device=pool.device))
