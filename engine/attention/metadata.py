"""What one forward pass needs to know about the ragged batch, built by the model runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """A step's T tokens from S sequences, laid out sequence after sequence.

    Sequence s owns query rows `query_start_loc[s]:query_start_loc[s+1]`; those tokens sit at
    positions `seq_lens[s] - query_len .. seq_lens[s] - 1` and attend causally to every key at
    a position up to their own. Before attention, each layer stores the step's new K/V at
    `slot_mapping` (slot = block_id * block_size + offset; -1 = do not store), so attention
    reads all keys, cached and new, from the pool through `block_tables`.

    Invariant (set by the model runner): sequences with one query token come first, so rows
    `0:num_decodes` are one token each — backends batch them together.
    """

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [S, max_blocks] int32, rows padded with 0
    query_lens_cpu: list[int]  # host copies: no device sync in backends' loops
    seq_lens_cpu: list[int]
    num_decodes: int  # leading sequences with exactly one query token
    max_query_len: int
    max_seq_len: int
    store_plan: tuple | None = None  # the torch backend's per-step cache (torch_backend.py)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def single_sequence(
        cls,
        start: int,
        num_new: int,
        block_size: int,
        num_blocks: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Positions start..start+num_new-1 of one sequence stored in blocks 0..num_blocks-1."""
        seq_len = start + num_new
        return cls(
            slot_mapping=torch.arange(start, seq_len, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor([0, num_new], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],
            query_lens_cpu=[num_new],
            seq_lens_cpu=[seq_len],
            num_decodes=1 if num_new == 1 else 0,
            max_query_len=num_new,
            max_seq_len=seq_len,
        )

    @classmethod
    def single_sequence_groups(
        cls,
        start: int,
        num_new: int,
        block_size: int,
        num_blocks: int,
        num_groups: int,
        device: torch.device | str = "cpu",
    ) -> list["AttentionMetadata"]:
        """`single_sequence` for each of `num_groups` KV groups, group g in blocks
        g * num_blocks .. (g + 1) * num_blocks - 1 (a pool of num_groups * num_blocks)."""
        out = []
        for g in range(num_groups):
            m = cls.single_sequence(start, num_new, block_size, num_blocks, device)
            m.slot_mapping += g * num_blocks * block_size
            m.block_tables += g * num_blocks
            out.append(m)
        return out
