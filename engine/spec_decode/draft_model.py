"""Draft-model proposer: a smaller model drafts k tokens greedily, one forward per token
over every sequence in the batch.

Two kinds of drafter:
- `self:N` (layer-skip self-speculation): the target's first N layers, its final norm and
  LM head. Those layers' KV *is* the target's KV for layers 0..N-1, so the drafter reads and
  writes the target's pool through the target's block tables: no second KV cache, nothing
  to catch up, and in disaggregated mode the prompt's draft KV arrives with the target's.
- A separate model (same vocabulary): its own KV pool, indexed by the target's block ids
  (same block size and count), so the block manager's tables, copy-on-write and rollback
  serve both. Each sequence's draft KV catches up from `SpecState.num_draft_computed` on
  its first proposal (the Proposal says how far it got) (the prompt, whether prefilled here or by a
  prefill worker: rebuilt on the decode worker, which keeps prefill workers and KV transfers unaware
  of drafting).

Drafts see the request's masks and penalties (so a constrained or penalized request is not
drafted tokens its target can never pick); the argmax is the draft."""

from __future__ import annotations

import numpy as np
import torch

from engine.attention import AttentionBackend
from engine.core.request import Request
from engine.kv.block_manager import BlockManager
from engine.models.interface import CausalLM, ForwardContext
from engine.runner.step_layout import batch_metadata, slots_of
from engine.sampling.sample_row import SampleRow
from engine.sampling.sampler import Sampler
from engine.spec_decode.proposer import Proposal


class DraftModelProposer:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        block_manager: BlockManager,
        sampler: Sampler,
        num_layers: int | None = None,
        owns_kv: bool = False,
    ) -> None:
        """`sampler`: the target's (its masks and penalty counts). `num_layers`: run only the
        first N layers of `model` (self:N). `owns_kv`: the pool is the drafter's own (a
        separate model), so each sequence catches up on it."""
        self.model, self.kv_cache, self.backend, self.bm = model, kv_cache, backend, block_manager
        self.sampler = sampler
        self.num_layers, self.owns_kv = num_layers, owns_kv
        self.block_size = kv_cache.shape[4]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if self.owns_kv:
            for src, dst in copies:
                self.kv_cache[dst].copy_(self.kv_cache[src])

    @torch.inference_mode()
    def propose(self, batch: list[tuple[Request, int]]) -> list[Proposal]:
        drafts: list[list[int]] = [[] for _ in batch]
        live = [i for i, (_, k) in enumerate(batch) if k > 0]
        step = 0
        while live:
            feeds = []  # (batch index, first position, input tokens)
            for i in live:
                request = batch[i][0]
                if step == 0:
                    spec = request.spec
                    assert spec is not None  # the proposer drafts for speculating requests
                    start = spec.num_draft_computed if self.owns_kv else request.num_tokens - 1
                    feeds.append((i, start, request.token_ids[start:]))
                else:
                    feeds.append((i, request.num_tokens - 1 + step, [drafts[i][-1]]))
            for i, token in zip([f[0] for f in feeds], self._next_tokens(feeds, batch, drafts)):
                drafts[i].append(token)
            step += 1
            live = [i for i in live if len(drafts[i]) < batch[i][1]]
        if not self.owns_kv:
            return [Proposal(d) for d in drafts]
        # Draft KV now covers every input fed: the sequence's tokens and all drafts but the last.
        return [
            Proposal(d, num_draft_computed=request.num_tokens - 1 + len(d) if d else None)
            for (request, _), d in zip(batch, drafts)
        ]

    def _next_tokens(self, feeds, batch, drafts) -> list[int]:
        """One forward over `feeds` (one-token rows first, as attention expects); the greedy
        draft after each feed's last row, in `feeds` order."""
        order = sorted(range(len(feeds)), key=lambda j: len(feeds[j][2]) != 1)
        groups = range(self.bm.num_groups)
        input_ids, positions, query_lens, seq_lens, last_rows = [], [], [], [], []
        slots: list[list] = [[] for _ in groups]  # per KV group, per feed
        tables: list[list[list[int]]] = [[] for _ in groups]
        row = 0
        for j in order:
            i, start, tokens = feeds[j]
            group_tables = self.bm.block_tables(batch[i][0].request_id)
            pos = np.arange(start, start + len(tokens))
            input_ids.append(np.asarray(tokens))
            positions.append(pos)
            for g in groups:
                slots[g].append(slots_of(group_tables[g], pos, self.block_size))
                tables[g].append(group_tables[g])
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            row += len(tokens)
            last_rows.append(row - 1)
        device = self.kv_cache.device
        ctx = ForwardContext.for_groups(
            self.backend,
            self.kv_cache,
            [batch_metadata(device, slots[g], tables[g], query_lens, seq_lens) for g in groups],
        )
        x = self.model.residual(
            torch.from_numpy(np.concatenate(input_ids)).to(device),
            torch.from_numpy(np.concatenate(positions)).to(device),
            ctx,
            self.num_layers,
        )
        logits = self.model.logits(x, ctx, torch.tensor(last_rows, device=device))
        rows = [
            SampleRow(
                batch[feeds[j][0]][0],
                batch[feeds[j][0]][0].completion_index,
                tuple(drafts[feeds[j][0]]),
            )
            for j in order
        ]
        self.sampler.adjust_logits(logits, rows)
        tokens = logits.argmax(-1).tolist()
        out = [0] * len(feeds)
        for j, token in zip(order, tokens):
            out[j] = token
        return out
