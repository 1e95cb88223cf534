"""Sleep / wake and weight updates of one engine's model and KV pool (vLLM's names).

- `sleep(1)`: the KV pool's memory is freed (its contents, and so the prefix cache, are
  gone) and the weights are offloaded to the CPU (on a CPU engine they already are).
  `sleep(2)`: the weights are dropped too. Both need an idle engine (workers drain first).
- `wake_up(tags)`: restores "weights" and/or "kv_cache" (both by default). Weights dropped by
  level 2 come back from an `update_weights` made while asleep, or else from the checkpoint
  the engine was started with.
- `update_weights(...)`: by checkpoint name, in place (`CausalLM.update_weights`); the engine
  then bumps the weights version, which is part of every block hash (KV computed by older
  weights can never be reused, even without a reset), and resets the prefix cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import torch

from engine.core.scheduler import Scheduler
from engine.kv.block_manager import BlockManager
from engine.models.interface import CausalLM
from engine.runner.weights import read_weights

TAGS = ("weights", "kv_cache")


class Lifecycle:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        scheduler: Scheduler,
        block_manager: BlockManager,
        reload: Callable[[], CausalLM],
        enable_sleep_mode: bool,
        moved: Callable[[], None] | None = None,
    ) -> None:
        """`kv_cache`: the pool, freed and reallocated in place (its tensor object stays, so
        whoever holds it sees the new memory). `scheduler`: asked whether the engine is idle.
        `reload`: the checkpoint the engine started with, loaded again (level-2 wake-up).
        `moved`: told before sleep frees the pool or the weights, and before a weight update
        (whatever holds their raw addresses, CUDA graphs, lets go)."""
        self.model, self.kv_cache, self.scheduler, self.bm = (
            model,
            kv_cache,
            scheduler,
            block_manager,
        )
        self.reload, self.enable_sleep_mode, self.moved = reload, enable_sleep_mode, moved
        self.level = 0  # 0 awake; else the level it sleeps at
        self.asleep: set[str] = set()  # what is not live: "weights", "kv_cache"
        self._kv_shape: torch.Size | None = None
        self._param_shapes: dict[str, torch.Size] = {}
        self._updated_while_dropped = False

    # ---- sleep / wake ------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        if not self.enable_sleep_mode:
            raise RuntimeError("sleep needs enable_sleep_mode (--enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.scheduler.has_unfinished():
            raise RuntimeError("sleep: requests are still running (finish or abort them first)")
        kv, model = self.kv_cache, self.model
        if self.moved is not None:
            self.moved()
        if "kv_cache" not in self.asleep:
            self.bm.reset_prefix_cache()  # the pool's contents go
            self._kv_shape = kv.shape
            empty = torch.empty(0, dtype=kv.dtype, device=kv.device)
            kv.set_(empty)  # type: ignore[call-overload]  # the stubs lack set_(Tensor)
            self.asleep.add("kv_cache")
        if level == 2 and self.level < 2:
            self._param_shapes = {n: p.shape for n, p in model.named_parameters()}
            for p in model.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._updated_while_dropped = False
            self.asleep.add("weights")
        elif level == 1 and kv.device.type != "cpu" and "weights" not in self.asleep:
            for p in model.parameters():
                p.data = p.data.to("cpu")
            self.asleep.add("weights")
        self.level = max(self.level, level)
        if kv.device.type == "cpu":
            _trim_heap()

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        tags = set(TAGS if tags is None else tags)
        unknown = tags - set(TAGS)
        if unknown:
            raise ValueError(f"wake_up tags must be among {TAGS}, got {sorted(unknown)}")
        kv = self.kv_cache
        if "weights" in tags and "weights" in self.asleep:
            if self.level == 2:
                self._restore_dropped()
            else:
                for p in self.model.parameters():
                    p.data = p.data.to(kv.device)
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            assert self._kv_shape is not None  # set when the pool went to sleep
            zeros = torch.zeros(self._kv_shape, dtype=kv.dtype, device=kv.device)
            kv.set_(zeros)  # type: ignore[call-overload]  # the stubs lack set_(Tensor)
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self.level = 0

    def _allocate_dropped(self) -> None:
        for name, p in self.model.named_parameters():
            if p.numel() == 0 and name in self._param_shapes:
                p.data = torch.zeros(self._param_shapes[name], dtype=p.dtype, device=p.device)

    def _restore_dropped(self) -> None:
        self._allocate_dropped()
        if self._updated_while_dropped:
            return
        fresh = self.reload()
        with torch.no_grad():
            for (_, p), (_, q) in zip(self.model.named_parameters(), fresh.named_parameters()):
                p.copy_(q)

    # ---- weights -----------------------------------------------------------------------------
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | str | Path) -> int:
        """Copy checkpoint-named weights (or a safetensors file / directory) into the model;
        how many were applied. The caller bumps the weights version."""
        if self.scheduler.has_unfinished():
            raise RuntimeError(
                "update_weights: requests are still running (finish or abort them first)"
            )
        if self.level == 2 and "weights" in self.asleep:
            self._allocate_dropped()
            self._updated_while_dropped = True
        if isinstance(weights, (str, Path)):
            weights = read_weights(weights)
        if self.moved is not None:  # copied in place, but a graph need not bet on it
            self.moved()
        return self.model.update_weights(weights)


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
