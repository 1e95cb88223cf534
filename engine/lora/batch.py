"""One forward's LoRA: which slot each token row uses, and the shrink/expand that adds
scale * B (A x) to a base projection's output for the rows with an adapter (the slots hold
B pre-multiplied by the scale).

Three paths, the same arithmetic:
- torch, small batches (decode steps, <= SMALL_BATCH rows): every slot's A and B as one
  (slots x rank)-wide matrix each: y += ((x @ A_all^T) * mask) @ B_all, the mask keeping each
  row's own slot's rank columns (zero for rows without an adapter). Two matmuls per target
  whatever the number of adapters (measured: 2x faster than a pair per slot at 8 adapters).
- torch, large batches (prefill chunks): rows grouped by slot (at most max_loras groups);
  per group and target one (rows x in) @ (in x r) and one (rows x r) @ (r x out) matmul,
  added with index_add_. Rows without an adapter cost nothing.
- Triton (with the fused kernels on, CUDA): kernels.lora_shrink / kernels.lora_expand, one
  launch each per target over all rows, each row gathering its slot's weights (Punica's
  BGMV)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from engine.lora.slots import LoRASlots

SMALL_BATCH = 64


@dataclass
class LoRABatch:
    slots: LoRASlots
    token_slots: torch.Tensor  # [T] slot of each row, -1 = none
    groups: list[tuple[int, torch.Tensor]]  # (slot, its rows), slots in use only
    kernels: ModuleType | None = None  # the `kernels` package: the Triton path
    mask: torch.Tensor | None = None  # [T, slots x rank]: the small-batch torch path

    @classmethod
    def build(
        cls,
        slots: LoRASlots,
        row_slots: list[int],
        device: torch.device,
        kernels: ModuleType | None = None,
    ) -> "LoRABatch":
        token_slots = torch.tensor(row_slots, dtype=torch.long)
        groups = [
            (s, (token_slots == s).nonzero().squeeze(1).to(device))
            for s in sorted(set(row_slots) - {-1})
        ]
        mask = None
        if kernels is None and len(row_slots) <= SMALL_BATCH:
            mask = torch.zeros(
                len(row_slots), slots.max_loras, slots.max_rank, dtype=slots.a["q_proj"].dtype
            )
            rows = token_slots >= 0
            mask[rows, token_slots[rows]] = 1
            mask = mask.view(len(row_slots), -1).to(device)
        return cls(slots, token_slots.to(device), groups, kernels, mask)

    def add(
        self, y: torch.Tensor, x: torch.Tensor, layer: int, parts: tuple[tuple[str, int], ...]
    ) -> None:
        """y [T, out_total] += the deltas of `parts` ((target, column offset in y)) for
        x [T, in]."""
        for target, offset in parts:
            users = [
                (slot, rows) for slot, rows in self.groups if target in self.slots.targets[slot]
            ]
            if not users:
                continue
            a, b = self.slots.a[target][layer], self.slots.b[target][layer]
            out = y[:, offset : offset + b.shape[1]]
            if self.kernels is not None:
                shrunk = self.kernels.lora_shrink(x, a, self.token_slots)
                self.kernels.lora_expand(out, shrunk, b, self.token_slots, self.slots.unit_scale)
                continue
            if self.mask is not None:
                bt = self.slots.bt[target][layer]
                out.addmm_(
                    (x @ a.reshape(-1, a.shape[-1]).T).mul_(self.mask), bt.reshape(-1, bt.shape[-1])
                )
                continue
            for slot, rows in users:
                out.index_add_(0, rows, (x[rows] @ a[slot].T) @ b[slot].T)
