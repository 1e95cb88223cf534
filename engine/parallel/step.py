"""One engine step's forward inputs, as numpy arrays: what rank 0 broadcasts to the other
ranks of a tensor-parallel group, and the forward every rank runs from them.

Rank 0's model runner builds a `StepInputs` from the scheduler's output
(engine/runner/model_runner.py) and, at tensor_parallel_size > 1, broadcasts it before running
`forward` itself; ranks 1..N-1
(rank_worker.py) receive it and run the same `forward` over their shard and KV pool, so every
rank reaches every collective in the same order. Block ids, slots and tables are the same on
every rank (each pool holds its own heads of the same blocks). Rank 0 alone samples, pools and
computes prompt logprobs from what `forward` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.lora.batch import LoRABatch
from engine.models.interface import CausalLM, ForwardContext


@dataclass(slots=True)
class GroupArrays:
    """One KV group's slot mapping [T] int64 and padded block tables [S, max_blocks] int32."""

    slot_mapping: np.ndarray
    block_tables: np.ndarray

    @classmethod
    def build(cls, slots: list, tables: list[list[int]]) -> "GroupArrays":
        """From the batch's slots in batch order, in pieces (arrays, lists or tuples: a
        sequence's, or the one-token sequences' together), and each sequence's block table."""
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        block_tables = np.zeros((len(tables), int(lens.max())), dtype=np.int32)
        # Row-major fill of each row's first len(table) columns (one pass, no per-row copy).
        block_tables[np.arange(block_tables.shape[1])[None, :] < lens[:, None]] = np.fromiter(
            chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum())
        )
        return cls(np.concatenate(slots).astype(np.int64, copy=False), block_tables)


@dataclass(slots=True)
class StepInputs:
    """A ragged batch of T tokens from S sequences (one-token sequences first), as numpy."""

    input_ids: np.ndarray
    """[T] int64."""
    positions: np.ndarray
    """[T] int64."""
    groups: list[GroupArrays]
    """Per KV group (engine/kv/kv_groups.py)."""
    query_lens: list[int]
    seq_lens: list[int]
    logits_rows: np.ndarray | None = None
    """Rows whose logits the step needs (None: the LM head is skipped on every rank)."""
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """Copy-on-write copies (src block, dst block) to make before the forward."""

    @classmethod
    def copies_only(cls, copies: list[tuple[int, int]]) -> "StepInputs":
        """A message that only copies blocks (no forward)."""
        empty = np.zeros(0, dtype=np.int64)
        return cls(empty, empty, [], [], [], None, copies)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def metadata(self, device: torch.device) -> list[AttentionMetadata]:
        """The AttentionMetadata of each KV group."""
        return [attention_metadata(device, g, self.query_lens, self.seq_lens) for g in self.groups]


def attention_metadata(
    device: torch.device, group: GroupArrays, query_lens: list[int], seq_lens: list[int]
) -> AttentionMetadata:
    to = lambda a, dtype: torch.from_numpy(np.asarray(a, dtype=dtype)).to(device)  # noqa: E731
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    return AttentionMetadata(
        slot_mapping=to(group.slot_mapping, np.int64),
        query_start_loc=to(np.concatenate([[0], np.cumsum(query_lens)]), np.int32),
        seq_lens=to(seq_lens, np.int32),
        block_tables=to(group.block_tables, np.int32),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def copy_blocks(kv_cache: torch.Tensor, copies: list[tuple[int, int]]) -> None:
    for src, dst in copies:
        kv_cache[dst].copy_(kv_cache[src])


def forward(
    model: CausalLM,
    backend: AttentionBackend,
    kv_cache: torch.Tensor,
    step: StepInputs,
    lora: LoRABatch | None = None,
    head_logits: bool = False,
) -> tuple[torch.Tensor, ForwardContext, torch.Tensor | None]:
    """The step's residual stream [T, dim], its context (for `model.hidden`) and the logits
    at `step.logits_rows` (None when it names none): the same collectives on every rank.
    The logits are fp32, or with `head_logits` the model's `head_logits` where it has them
    (the LM head's dtype, no fp32 copy: for a sampler that reads them so)."""
    device = kv_cache.device
    ctx = ForwardContext.for_groups(backend, kv_cache, step.metadata(device), lora)
    x = model.residual(
        torch.from_numpy(step.input_ids).to(device),
        torch.from_numpy(step.positions).to(device),
        ctx,
    )
    logits = None
    if step.logits_rows is not None:
        rows = torch.from_numpy(step.logits_rows).to(device)
        narrow = getattr(model, "head_logits", None) if head_logits else None
        logits = narrow(x, ctx, rows) if narrow is not None else model.logits(x, ctx, rows)
    return x, ctx, logits
