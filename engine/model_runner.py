"""Flattens a scheduled step into one ragged batch, runs the model, samples.

The runner owns the KV pool and the attention backend; it never decides policy: the
scheduler says which requests compute how many tokens, the runner lays them out (one-token
rows first, see AttentionMetadata) and samples where a request has computed all its known
tokens."""
from __future__ import annotations

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.block_manager import BlockManager
from engine.models.llama import ForwardContext, Transformer
from engine.sampler import SampleRow, sample
from engine.scheduler import SampledToken, SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        block_manager: BlockManager,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.bm = block_manager
        self.block_size = kv_cache.shape[3]
        self.device = kv_cache.device

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[str, list[SampledToken]]:
        for src, dst in output.block_copies:
            self.kv_cache[dst].copy_(self.kv_cache[src])
        if not output.scheduled:
            return {}
        # One-token rows first: backends batch them (AttentionMetadata invariant).
        order = sorted(output.scheduled, key=lambda item: item[1] != 1)
        input_ids, positions, slots, tables = [], [], [], []
        query_lens, seq_lens, sample_at, sample_rows = [], [], [], []
        row = 0
        for request, n in order:
            start = request.num_computed_tokens
            table = self.bm.block_table(request.request_id)
            pos = np.arange(start, start + n)
            input_ids.append(np.asarray(request.token_ids[start : start + n]))
            positions.append(pos)
            slots.append(np.asarray(table)[pos // self.block_size] * self.block_size + pos % self.block_size)
            tables.append(table)
            query_lens.append(n)
            seq_lens.append(start + n)
            row += n
            if start + n == request.num_tokens:  # all known tokens computed: draw the next
                for index in range(request.sampling.n if request.pending_forks else 1):
                    sample_at.append(row - 1)
                    sample_rows.append(SampleRow(request, index or request.completion_index))

        metadata = self._metadata(slots, tables, query_lens, seq_lens)
        # A step of prefill chunks only has no rows to sample: the head is skipped.
        logits = self.model(
            torch.from_numpy(np.concatenate(input_ids)).to(self.device),
            torch.from_numpy(np.concatenate(positions)).to(self.device),
            ForwardContext(self.backend, self.kv_cache, metadata),
            logits_indices=torch.tensor(sample_at, dtype=torch.long, device=self.device),
        )
        if not sample_at:
            return {}
        tokens = sample(logits, sample_rows)
        out: dict[str, list[SampledToken]] = {}
        for sample_row, token in zip(sample_rows, tokens):
            out.setdefault(sample_row.request.request_id, []).append(token)
        return out

    def _metadata(self, slots, tables, query_lens, seq_lens) -> AttentionMetadata:
        width = max(len(t) for t in tables)
        block_tables = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = t
        to = lambda a, dtype: torch.from_numpy(np.asarray(a, dtype=dtype)).to(self.device)  # noqa: E731
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        return AttentionMetadata(
            slot_mapping=to(np.concatenate(slots), np.int64),
            query_start_loc=to(np.concatenate([[0], np.cumsum(query_lens)]), np.int32),
            seq_lens=to(seq_lens, np.int32),
            block_tables=to(block_tables, np.int32),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
