"""One forward's LoRA: which slot each token row uses, and the shrink/expand that adds
scale * B (A x) to a base projection's output for the rows with an adapter.

The torch path groups rows by slot (at most max_loras groups): per group and target one
(rows x in) @ (in x r) and one (rows x r) @ (r x out) matmul, added with index_add_. Rows
without an adapter cost nothing. With the Triton kernels on (CUDA) the same runs as the
batched gather kernels kernels.lora_shrink / kernels.lora_expand over all rows."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lora.slots import LoRASlots


@dataclass
class LoRABatch:
    slots: LoRASlots
    token_slots: torch.Tensor  # [T] slot of each row, -1 = none
    groups: list[tuple[int, torch.Tensor]]  # (slot, its rows), slots in use only

    @classmethod
    def build(cls, slots: LoRASlots, row_slots: list[int], device: torch.device) -> "LoRABatch":
        token_slots = torch.tensor(row_slots, dtype=torch.long)
        groups = [(s, (token_slots == s).nonzero().squeeze(1).to(device))
                  for s in sorted(set(row_slots) - {-1})]
        return cls(slots, token_slots.to(device), groups)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, parts: tuple[tuple[str, int], ...]) -> None:
        """y [T, out_total] += the deltas of `parts` ((target, column offset in y)) for x [T, in]."""
        for target, offset in parts:
            a, b = self.slots.a[target][layer], self.slots.b[target][layer]
            width = b.shape[1]
            out = y[:, offset : offset + width]
            for slot, rows in self.groups:
                if target not in self.slots.targets[slot]:
                    continue
                out.index_add_(0, rows, (x[rows] @ a[slot].T) @ b[slot].T)
