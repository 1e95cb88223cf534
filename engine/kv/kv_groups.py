"""How a model's layers share the KV pool's blocks (vLLM's hybrid KV-cache manager idea).

A block of the pool holds `group_size` layers' K and V for `block_size` tokens. Layers that
attend alike (full attention, or the same sliding window) are cut into groups of `group_size`
layers, and every group has its own block table per request: a sliding group's table can then
give back the blocks that slid out of its window while a full-attention group keeps the whole
history. A model whose layers all attend alike is one group of all its layers — the pool is
then `[num_blocks, kv_heads, num_layers, 2, block_size, head_dim]` (heads first inside a
block, engine/kv/kv_pool.py).

`group_size` is the smallest number of layers of one kind (Gemma 3 270M: 3 full-attention
layers and 15 sliding ones -> one full group and five sliding groups of 3); a kind whose count
is not a multiple leaves the last group's spare layer slots unused. Full-attention groups come
first, so group 0 keeps every block whenever the model has a full-attention layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    layers: tuple[tuple[int, ...], ...]
    """Group g's layers, in layer order."""
    windows: tuple[int | None, ...]
    """Group g's sliding window (None: full attention)."""
    group_size: int
    """Layers one block holds (a group may use fewer)."""

    @classmethod
    def from_windows(cls, windows: Sequence[int | None]) -> "KVGroups":
        """The grouping of layers with these windows (None: full attention)."""
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            kinds.setdefault(window, []).append(layer)
        size = min(len(layers) for layers in kinds.values())
        layers, group_windows = [], []
        for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):
            members = kinds[window]
            for i in range(0, len(members), size):
                layers.append(tuple(members[i : i + size]))
                group_windows.append(window)
        return cls(tuple(layers), tuple(group_windows), size)

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot in the group's blocks) of `layer`."""
        for g, members in enumerate(self.layers):
            if layer in members:
                return g, members.index(layer)
        raise ValueError(f"layer {layer} is in no KV group")
