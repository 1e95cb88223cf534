"""Flattens a scheduled step into one ragged batch, runs the model, samples.

The runner owns the KV pool and the attention backend; it never decides policy: the
scheduler says which requests compute how many tokens, the runner lays them out (one-token
rows first, see AttentionMetadata) and samples where a request has computed all its known
tokens.

A request asking for prompt logprobs also gets logits at each prompt position it runs (chunk
by chunk); the runner records them on the request (`Request.prompt_logprobs`). A pooling
request (engine/pooling.py) gets the final-normed hidden state, no logits, at the rows it pools
and never samples. Everyone else only gets logits where it samples."""
from __future__ import annotations

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.block_manager import BlockManager
from engine.models.llama import ForwardContext, Transformer
from engine.request import Logprob, Request
from engine.sampler import SampleRow, sample, token_ranks
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
        prompt_spans: list[tuple[Request, int, int]] = []  # (request, first position, end)
        prompt_rows: list[int] = []
        pool_spans: list[tuple[Request, int]] = []  # (pooling request, its rows here)
        pool_rows: list[int] = []
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
            if request.pooling is not None:
                rows = request.pooling.rows(start, n, request.num_prompt_tokens)
                if rows:
                    pool_spans.append((request, len(rows)))
                    pool_rows.extend(range(row + rows.start - start, row + rows.stop - start))
            elif request.sampling.prompt_logprobs is not None:
                # Position p predicts prompt token p + 1; skip positions already recorded
                # (recomputed after a preemption) and the last prompt position (it samples).
                first = max(start, len(request.prompt_logprobs))
                end = min(start + n, request.num_prompt_tokens - 1)
                if first < end:
                    prompt_spans.append((request, first, end))
                    prompt_rows.extend(range(row + first - start, row + end - start))
            row += n
            if start + n == request.num_tokens and request.pooling is None:  # draw the next
                for index in range(request.sampling.n if request.pending_forks else 1):
                    sample_at.append(row - 1)
                    sample_rows.append(SampleRow(request, index or request.completion_index))

        metadata = self._metadata(slots, tables, query_lens, seq_lens)
        ctx = ForwardContext(self.backend, self.kv_cache, metadata)
        x = self.model.residual(
            torch.from_numpy(np.concatenate(input_ids)).to(self.device),
            torch.from_numpy(np.concatenate(positions)).to(self.device),
            ctx,
        )
        if pool_spans:
            hidden = self.model.hidden(x, ctx, self._index(pool_rows)).float()
            for (request, _), part in zip(pool_spans, hidden.split([c for _, c in pool_spans])):
                request.pooling.add(part, request.num_prompt_tokens)
        if not sample_at and not prompt_rows:
            return {}  # prefill chunks and pooling only: the LM head is skipped
        logits = self.model.logits(x, ctx, self._index(sample_at + prompt_rows))
        if prompt_spans:
            _record_prompt_logprobs(logits[len(sample_at) :], prompt_spans)
        if not sample_at:
            return {}
        tokens = sample(logits[: len(sample_at)], sample_rows)
        out: dict[str, list[SampledToken]] = {}
        for sample_row, token in zip(sample_rows, tokens):
            out.setdefault(sample_row.request.request_id, []).append(token)
        return out

    def _index(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

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


def _record_prompt_logprobs(logits: torch.Tensor, spans: list[tuple[Request, int, int]]) -> None:
    """`logits`: one row per prompt position of `spans` (request, first, end), in order;
    appends a Logprob for prompt tokens first + 1 .. end to each request."""
    logprobs = logits.log_softmax(-1)
    targets = [t for req, first, end in spans for t in req.prompt_token_ids[first + 1 : end + 1]]
    chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device)[:, None])
    ranks = token_ranks(logprobs, chosen).tolist()
    chosen = chosen.squeeze(1).tolist()
    k = max(req.sampling.prompt_logprobs for req, _, _ in spans)
    top_vals, top_ids = (t.tolist() for t in logprobs.topk(k))
    i = 0
    for req, first, end in spans:
        n = req.sampling.prompt_logprobs
        for _ in range(end - first):
            top = list(zip(top_ids[i][:n], top_vals[i][:n]))
            req.prompt_logprobs.append(Logprob(targets[i], chosen[i], top, ranks[i]))
            i += 1
