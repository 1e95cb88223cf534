"""Sleep / wake, weight updates and collective_rpc for one engine (vLLM's names).

- `sleep(1)`: the KV pool's memory is freed (its contents, and so the prefix cache, are
  gone) and the weights are offloaded to the CPU (on a CPU engine they already are).
  `sleep(2)`: the weights are dropped too. Both need an idle engine (workers drain first).
- `wake_up(tags)`: restores "weights" and/or "kv_cache" (both by default). Weights dropped by
  level 2 come back from an `update_weights` made while asleep, or else from the checkpoint
  the engine was started with.
- `update_weights(...)`: engine/weights.py; bumps the weights version, which is part of every
  block hash (KV computed by older weights can never be reused, even without a reset), and
  resets the prefix cache.
- `collective_rpc(method, args, kwargs)`: calls `method` on the worker extension
  (`worker_extension_cls`, built as Class(engine)) if it has it, else on the engine; returns
  the list of results (one per engine: one offline, one per worker in a cluster).
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch

from engine.models.llama import Transformer
from engine.weights import apply_weights, read_weights

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

TAGS = ("weights", "kv_cache")


class Lifecycle:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.level = 0  # 0 awake; else the level it sleeps at
        self.asleep: set[str] = set()  # what is not live: "weights", "kv_cache"
        self._kv_shape: torch.Size | None = None
        self._param_shapes: dict[str, torch.Size] = {}
        self._updated_while_dropped = False
        self.extension = None
        if engine.config.worker_extension_cls:
            module, _, cls = engine.config.worker_extension_cls.partition(":")
            self.extension = getattr(importlib.import_module(module), cls)(engine)

    # ---- sleep / wake ------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        engine = self.engine
        if not engine.config.enable_sleep_mode:
            raise RuntimeError("sleep needs enable_sleep_mode (--enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if engine.has_unfinished_requests():
            raise RuntimeError("sleep: requests are still running (finish or abort them first)")
        if "kv_cache" not in self.asleep:
            engine.block_manager.reset_prefix_cache()  # the pool's contents go
            self._kv_shape = engine.kv_cache.shape
            engine.kv_cache.set_(torch.empty(0, dtype=engine.kv_cache.dtype, device=engine.kv_cache.device))
            self.asleep.add("kv_cache")
        model = engine.loaded.model
        if level == 2 and self.level < 2:
            self._param_shapes = {n: p.shape for n, p in model.named_parameters()}
            for p in model.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._updated_while_dropped = False
            self.asleep.add("weights")
        elif level == 1 and engine.device.type != "cpu" and "weights" not in self.asleep:
            for p in model.parameters():
                p.data = p.data.to("cpu")
            self.asleep.add("weights")
        self.level = max(self.level, level)
        if engine.device.type == "cpu":
            _trim_heap()

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        tags = set(TAGS if tags is None else tags)
        unknown = tags - set(TAGS)
        if unknown:
            raise ValueError(f"wake_up tags must be among {TAGS}, got {sorted(unknown)}")
        engine = self.engine
        if "weights" in tags and "weights" in self.asleep:
            if self.level == 2:
                self._restore_dropped()
            else:
                for p in engine.loaded.model.parameters():
                    p.data = p.data.to(engine.device)
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            engine.kv_cache.set_(torch.zeros(self._kv_shape, dtype=engine.kv_cache.dtype,
                                             device=engine.kv_cache.device))
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self.level = 0

    def _allocate_dropped(self) -> None:
        model = self.engine.loaded.model
        for name, p in model.named_parameters():
            if p.numel() == 0 and name in self._param_shapes:
                p.data = torch.zeros(self._param_shapes[name], dtype=p.dtype, device=p.device)

    def _restore_dropped(self) -> None:
        self._allocate_dropped()
        if self._updated_while_dropped:
            return
        from engine.models.loader import load_model  # the original checkpoint

        engine = self.engine
        fresh = load_model(engine.config.model, engine.dtype, engine.device, engine.config.num_layers)
        with torch.no_grad():
            for (_, p), (_, q) in zip(engine.loaded.model.named_parameters(), fresh.model.named_parameters()):
                p.copy_(q)

    # ---- weights -----------------------------------------------------------------------------
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | str | Path) -> int:
        engine = self.engine
        if engine.has_unfinished_requests():
            raise RuntimeError("update_weights: requests are still running (finish or abort them first)")
        if self.level == 2 and "weights" in self.asleep:
            self._allocate_dropped()
            self._updated_while_dropped = True
        if isinstance(weights, (str, Path)):
            weights = read_weights(weights)
        model = engine.loaded.model
        if isinstance(model, Transformer):
            applied = apply_weights(model, engine.loaded.args, weights)
        else:  # an out-of-tree architecture (engine/models/registry.py) knows its own names
            weights = list(weights)
            model.load_weights(weights)
            applied = len(weights)
        engine.weights_version += 1
        engine.reset_prefix_cache()
        return applied

    # ---- collective_rpc ---------------------------------------------------------------------
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list:
        has = self.extension is not None and hasattr(self.extension, method)
        target = self.extension if has else self.engine
        fn = getattr(target, method, None)
        if fn is None or method.startswith("_"):
            raise ValueError(f"collective_rpc: no method {method!r} on the engine or its extension")
        return [fn(*args, **(kwargs or {}))]


def _trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc keeps freed small blocks — most weight
    matrices here are a few MiB — in its arenas; the pool is mmapped and returns anyway)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
