"""Adapters for the forward: `max_loras` slots of stacked weights on the model's device, and
the CPU cache of loaded adapters (`max_cpu_loras`).

Per target projection the slots hold A [layers, max_loras, max_rank, in] and B [layers,
max_loras, out, max_rank] (B pre-multiplied by the adapter's scale; ranks below max_rank are
zero-padded, so padded columns add nothing). A slot is (re)filled when a step needs an adapter
that is not resident: the least recently used slot not needed by the same step is reused.
The scheduler guarantees a step needs at most `max_loras` adapters."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from engine.lora.adapter import TARGETS, LoRAAdapter, LoRAError, load_adapter, target_shapes
from engine.lora.request import LoRARequest
from engine.models.config import ModelArgs


class LoRASlots:
    def __init__(
        self,
        args: ModelArgs,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        shapes = target_shapes(args)
        layers = args.n_layers
        self.a = {
            t: torch.zeros(layers, max_loras, max_rank, shapes[t][0], dtype=dtype, device=device)
            for t in TARGETS
        }
        self.b = {
            t: torch.zeros(layers, max_loras, shapes[t][1], max_rank, dtype=dtype, device=device)
            for t in TARGETS
        }
        # B transposed, [layers, max_loras, max_rank, out]: all slots' B as one (slots x rank,
        # out) matrix for the torch path's small batches (engine/lora/batch.py).
        self.bt = {
            t: torch.zeros(layers, max_loras, max_rank, shapes[t][1], dtype=dtype, device=device)
            for t in TARGETS
        }
        self.targets: list[set[str]] = [set() for _ in range(max_loras)]  # what each slot adds
        self.unit_scale = torch.ones(
            max_loras, dtype=torch.float32, device=device
        )  # B is pre-scaled
        self._resident: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU first

    def slot_of(self, lora_id: int) -> int | None:
        return self._resident.get(lora_id)

    def prepare(self, adapters: list[LoRAAdapter]) -> dict[int, int]:
        """Make every adapter of a step resident; lora id -> slot."""
        needed = {a.lora_int_id for a in adapters}
        assert len(needed) <= self.max_loras, "the scheduler admits at most max_loras per step"
        out = {}
        for adapter in adapters:
            lora_id = adapter.lora_int_id
            if lora_id in out:
                continue
            if lora_id not in self._resident:
                self._load(adapter, self._free_slot(needed))
            self._resident.move_to_end(lora_id)
            out[lora_id] = self._resident[lora_id]
        return out

    def evict(self, lora_id: int) -> None:
        slot = self._resident.pop(lora_id, None)
        if slot is not None:
            self.targets[slot] = set()

    def _free_slot(self, needed: set[int]) -> int:
        used = set(self._resident.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            return free[0]
        victim = next(i for i in self._resident if i not in needed)
        return self._resident.pop(victim)

    def _load(self, adapter: LoRAAdapter, slot: int) -> None:
        r = adapter.rank
        for t in TARGETS:
            self.a[t][:, slot].zero_()
            self.b[t][:, slot].zero_()
            self.bt[t][:, slot].zero_()
        targets = set()
        for (layer, t), (a, b) in adapter.weights.items():
            self.a[t][layer, slot, :r].copy_(a)
            self.b[t][layer, slot, :, :r].copy_(b * adapter.scale)
            self.bt[t][layer, slot, :r].copy_((b * adapter.scale).T)
            targets.add(t)
        self.targets[slot] = targets
        self._resident[adapter.lora_int_id] = slot


class LoRACache:
    """Loaded adapters on the CPU, LRU over `max_cpu_loras`. Thread-safe: requests load their
    adapter where they are built (off the engine thread). A request keeps its adapter object,
    so eviction here never takes weights from a running request."""

    def __init__(self, args: ModelArgs, max_rank: int, max_cpu_loras: int) -> None:
        self.args, self.max_rank, self.capacity = args, max_rank, max_cpu_loras
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, loading it from `request.lora_path` if it is not cached (raises
        LoRAError). The same id must always name the same adapter."""
        with self._lock:
            adapter = self._adapters.get(request.lora_int_id)
            if adapter is not None:
                if adapter.request.lora_name != request.lora_name:
                    raise LoRAError(
                        f"lora_int_id {request.lora_int_id} is already adapter "
                        f"{adapter.request.lora_name!r}, not {request.lora_name!r}"
                    )
                self._adapters.move_to_end(request.lora_int_id)
                return adapter
        adapter = load_adapter(request, self.args, self.max_rank)  # disk: outside the lock
        with self._lock:
            self._adapters[request.lora_int_id] = adapter
            while len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)
        return adapter

    def remove(self, lora_id: int) -> bool:
        with self._lock:
            return self._adapters.pop(lora_id, None) is not None

    def ids(self) -> set[int]:
        with self._lock:
            return set(self._adapters)

    def requests(self) -> list[LoRARequest]:
        with self._lock:
            return [a.request for a in self._adapters.values()]
