"""Flattens a scheduled step into one ragged batch, runs the model, samples.

The runner owns the KV pool and the attention backend; it never decides policy: the
scheduler says which requests compute how many tokens, the runner lays them out (one-token
rows first, see AttentionMetadata) and samples where a request has computed all its known
tokens.

A request asking for prompt logprobs also gets logits at each prompt position it runs (chunk
by chunk). A pooling request (engine/pooling.py) gets the final-normed hidden state, no
logits, at the rows it pools and never samples. Everyone else only gets logits where it
samples. What a step computed comes back as one RunnerOutput; the runner never writes a
request. What it keeps across steps (the sampler's penalty counts, mean-pooling sums) is
keyed by request id and dropped when the scheduler says a request left (`prepare`)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.block_manager import BlockManager
from engine.cuda_graphs import DecodeGraphs
from engine.lora.batch import LoRABatch
from engine.lora.slots import LoRASlots
from engine.models.interface import CausalLM
from engine.models.layers import pack_linears
from engine.parallel.step import GroupArrays, StepInputs, attention_metadata, copy_blocks, forward
from engine.pooler import Pooler
from engine.request import Request
from engine.sample_row import SampleRow
from engine.sampler import Sampler, raw_logprobs, token_ranks, with_logprobs
from engine.scheduler_output import RunnerOutput, SchedulerOutput
from engine.spec_decode.verify import accepted_prefix, rejection_sample
from engine.tokens import Logprob, SampledToken


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        block_manager: BlockManager,
        lora_slots: LoRASlots | None = None,
        send_step: Callable[[StepInputs], None] | None = None,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        """`send_step` (tensor parallel, engine/parallel): hands each step's inputs to the
        other ranks before this rank runs the forward. `graphs`: CUDA graphs that replay
        all-decode steps (engine/cuda_graphs.py; never with `send_step`)."""
        if graphs is not None and send_step is not None:
            raise ValueError("CUDA graphs replay one rank's forward: not with tensor parallelism")
        self.model = model
        self.send_step = send_step
        self.graphs = graphs
        pack_linears(model)  # bf16 on the CPU: decode-sized projections from packed weights
        self.lora_slots = lora_slots
        self.kv_cache = kv_cache
        self.backend = backend
        self.bm = block_manager
        self.block_size = kv_cache.shape[3]
        self.device = kv_cache.device
        self.sampler = Sampler()
        self.pooler = Pooler()
        self.has_run = False
        """Whether a step has run (its K/V may be in the pool since): `warm_up` refuses then."""

    def prepare(self, output: SchedulerOutput) -> None:
        """Before anything reads or writes this step's blocks (a proposer included): forget
        the requests that left or were preempted, then run the copy-on-write copies."""
        left = output.finished_req_ids + [r.request_id for r in output.preempted]
        if left:
            self.sampler.forget(left)
            self.pooler.forget(left)
        if output.block_copies:
            copy_blocks(self.kv_cache, output.block_copies)
            if self.send_step is not None:  # every rank's pool copies its heads
                self.send_step(StepInputs.copies_only(list(output.block_copies)))

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """The step's forward and draws (after `prepare`)."""
        result = RunnerOutput()
        if not output.scheduled:
            return result
        self.has_run = True
        # One-token rows first: backends batch them (AttentionMetadata invariant).
        order = sorted(output.scheduled, key=lambda item: item[1] != 1)
        groups = range(self.bm.num_groups)
        # Decode rows (first in `order`) as flat ints, one array each at the end; the other
        # rows as one array per request after them.
        decode_ids: list[int] = []
        decode_positions: list[int] = []
        decode_slots: list[list[int]] = [[] for _ in groups]
        input_ids, positions = [], []
        slots: list[list] = [[] for _ in groups]  # per KV group, per request (not decodes)
        tables: list[list[list[int]]] = [[] for _ in groups]
        query_lens, seq_lens, sample_at, sample_rows = [], [], [], []
        prompt_spans: list[tuple[Request, int, int]] = []  # (request, first position, end)
        prompt_rows: list[int] = []
        pool_spans: list[tuple[Request, int]] = []  # (pooling request, its rows here)
        pool_rows: list[int] = []
        row = 0
        verify: list[tuple[Request, int]] = []  # (request with drafts, its first sample row)
        for request, n in order:
            start = request.num_computed_tokens
            drafts = request.spec.drafts if request.spec is not None else []
            group_tables = self.bm.block_tables(request.request_id)
            if n == 1:  # a decode row: plain ints (no per-row arrays)
                decode_ids.append(request.token_ids[start])
                decode_positions.append(start)
                block, offset = divmod(start, self.block_size)
                for g in groups:
                    decode_slots[g].append(group_tables[g][block] * self.block_size + offset)
            else:
                pos = np.arange(start, start + n)
                input_ids.append(request.token_ids[start : start + n - len(drafts)] + drafts)
                positions.append(pos)
                for g in groups:
                    slots[g].append(slots_of(group_tables[g], pos, self.block_size))
            for g in groups:
                tables[g].append(group_tables[g])
            query_lens.append(n)
            seq_lens.append(start + n)
            if request.pooling is not None:
                rows = self.pooler.rows(request, start, n)
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
            if drafts:  # verify: every draft position and the one after the last draft
                verify.append((request, len(sample_rows)))
                for j in range(len(drafts) + 1):
                    sample_at.append(row - 1 - len(drafts) + j)
                    sample_rows.append(SampleRow(request, request.completion_index, tuple(drafts[:j])))
            elif start + n == request.num_tokens and request.pooling is None:  # draw the next
                for index in range(request.sampling.n if request.pending_forks else 1):
                    sample_at.append(row - 1)
                    sample_rows.append(SampleRow(request, index or request.completion_index))

        logits_rows = sample_at + prompt_rows  # none: prefill chunks and pooling only, no LM head
        flat = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
        step = StepInputs(
            np.concatenate([flat(decode_ids), *input_ids]).astype(np.int64, copy=False),
            np.concatenate([flat(decode_positions), *positions]).astype(np.int64, copy=False),
            [GroupArrays.build([flat(decode_slots[g]), *slots[g]], tables[g]) for g in groups],
            query_lens, seq_lens, flat(logits_rows) if logits_rows else None)
        if self.send_step is not None:
            self.send_step(step)
        lora = self._lora_batch(order)
        head_logits = False
        logits = None
        if (self.graphs is not None and len(decode_ids) == len(order) and lora is None
                and not prompt_rows and not verify and not pool_spans):
            logits = self.graphs.logits(step)  # None: this step runs eagerly
        if logits is None:
            # The LM head's own dtype where the sampler reads it so (no fp32 copy of the logits).
            head_logits = (bool(sample_rows) and not prompt_rows and not verify
                           and self.sampler.reads_head_logits(sample_rows, self.device))
            x, ctx, logits = forward(self.model, self.backend, self.kv_cache, step, lora, head_logits)
        if pool_spans:
            hidden = self.model.hidden(x, ctx, self._index(pool_rows)).float()
            for (request, _), part in zip(pool_spans, hidden.split([c for _, c in pool_spans])):
                embedding = self.pooler.add(request, part)
                if embedding is not None:
                    result.pooled[request.request_id] = embedding
        if logits is None:
            return result
        if prompt_spans:
            result.prompt_logprobs = _prompt_logprobs(logits[len(sample_at) :], prompt_spans)
        if sample_at:
            result.sampled = self._sample(logits[: len(sample_at)], sample_rows, verify,
                                          output.draft_probs, head_logits)
        return result

    def _sample(
        self, logits: torch.Tensor, rows: list[SampleRow], verify: list[tuple[Request, int]],
        draft_probs: dict[str, torch.Tensor], plainly: bool,
    ) -> dict[str, list[SampledToken]]:
        """Draw every row; a request with drafts keeps what verification accepts
        (engine/spec_decode/verify.py) plus the target's token. `plainly`: the sampler said
        it reads these rows' logits as the LM head made them."""
        with_q = {first: request for request, first in verify if request.request_id in draft_probs}
        q_rows = {first + j for first, r in with_q.items() for j in range(len(r.spec.drafts) + 1)}
        tokens: list[SampledToken | None]
        if not q_rows:  # the usual step: every row samples at once (a view, no copy)
            tokens = self.sampler.sample(logits, rows, plainly or None)
        else:
            plain = [i for i in range(len(rows)) if i not in q_rows]
            tokens = [None] * len(rows)
            for i, token in zip(plain, self.sampler.sample(logits[plain], [rows[i] for i in plain])):
                tokens[i] = token
        out: dict[str, list[SampledToken]] = {}
        for request, first in verify:
            drafts = request.spec.drafts
            span = slice(first, first + len(drafts) + 1)
            if first in with_q:
                kept = self._rejection_sample(logits[span], rows[span], drafts,
                                              draft_probs[request.request_id])
            else:
                drawn = tokens[span]
                kept = drawn[: accepted_prefix([t.token_id for t in drawn], drafts) + 1]
            out[request.request_id] = kept
        verified = {first + j for request, first in verify for j in range(len(request.spec.drafts) + 1)}
        for i, (row, token) in enumerate(zip(rows, tokens)):
            if i not in verified:
                out.setdefault(row.request.request_id, []).append(token)
        return out

    @torch.inference_mode()
    def warm_up(self, prompt_len: int = 32) -> None:
        """Before the first request: a forward of one `prompt_len`-token prompt, then one of a
        decode row, each with the LM head (on every rank), so that the first request does not
        pay for first use — oneDNN primitives, kernels, the thread pool, first allocations:
        100-250 ms of a first 256-token prefill on a 2-core CPU. Their K/V land in the pool's
        first blocks, which is only harmless while no block holds anything (a request writes
        a block before it reads it, and none is cached yet): refused after that. With CUDA
        graphs, every decode size is captured here too (engine/cuda_graphs.py)."""
        if self.has_run or self.bm.pool.num_free_blocks < self.bm.pool.num_blocks:
            raise RuntimeError("warm_up: only before the first request")
        prompt_len = max(1, min(prompt_len, self.bm.pool.num_blocks * self.block_size))
        table = list(range(-(-prompt_len // self.block_size)))
        positions = np.arange(prompt_len)
        for rows in (positions, positions[-1:]):  # the prompt; its next token's decode row
            slots = slots_of(table, rows, self.block_size)
            step = StepInputs(np.zeros(len(rows), dtype=np.int64), rows.astype(np.int64),
                              [GroupArrays.build([slots], [table]) for _ in range(self.bm.num_groups)],
                              [len(rows)], [int(rows[-1]) + 1], np.array([len(rows) - 1]))
            if self.send_step is not None:
                self.send_step(step)
            forward(self.model, self.backend, self.kv_cache, step, None, True)
        if self.graphs is not None:  # every decode size, before the first request
            self.graphs.capture_all()

    def _lora_batch(self, order: list[tuple[Request, int]]) -> LoRABatch | None:
        """The step's adapters made resident, and each row's slot; None if no row has one."""
        adapters = [r.lora for r, _ in order if r.lora is not None]
        if not adapters:
            return None
        slot_of = self.lora_slots.prepare(adapters)
        row_slots = [slot_of[r.lora.lora_int_id] if r.lora is not None else -1
                     for r, n in order for _ in range(n)]
        return LoRABatch.build(self.lora_slots, row_slots, self.device, self.model.kernels)

    def evict_lora(self, lora_id: int) -> None:
        if self.lora_slots is not None:
            self.lora_slots.evict(lora_id)

    def _index(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _rejection_sample(self, logits: torch.Tensor, rows: list[SampleRow], drafts: list[int],
                          q: torch.Tensor) -> list[SampledToken]:
        """Drafts that came with their distributions `q`: the standard min(1, p/q) rule."""
        raw_idx, raw = raw_logprobs(logits, rows)
        kept = rejection_sample(self.sampler.target_probs(logits, rows), q, drafts, rows)
        n = len(kept)
        return with_logprobs(kept, rows[:n], ([i for i in raw_idx if i < n], None if raw is None else raw[:n]))


def batch_metadata(
    device: torch.device, slots: list[np.ndarray], tables: list[list[int]],
    query_lens: list[int], seq_lens: list[int],
) -> AttentionMetadata:
    """AttentionMetadata of a ragged batch laid out sequence after sequence (one-token
    sequences first: the caller orders them so)."""
    return attention_metadata(device, GroupArrays.build(slots, tables), query_lens, seq_lens)


def slots_of(table: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    """KV slots (block_id * block_size + offset) of `positions` in a block table."""
    return np.asarray(table)[positions // block_size] * block_size + positions % block_size


def _prompt_logprobs(logits: torch.Tensor, spans: list[tuple[Request, int, int]]) -> dict[str, list[Logprob]]:
    """`logits`: one row per prompt position of `spans` (request, first, end), in order;
    a Logprob for prompt tokens first + 1 .. end of each request, by request id."""
    logprobs = logits.log_softmax(-1)
    targets = [t for req, first, end in spans for t in req.prompt_token_ids[first + 1 : end + 1]]
    chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device)[:, None])
    ranks = token_ranks(logprobs, chosen).tolist()
    chosen = chosen.squeeze(1).tolist()
    k = max(req.sampling.prompt_logprobs for req, _, _ in spans)
    top_vals, top_ids = (t.tolist() for t in logprobs.topk(k))
    out: dict[str, list[Logprob]] = {}
    i = 0
    for req, first, end in spans:
        n = req.sampling.prompt_logprobs
        entries = out[req.request_id] = []
        for _ in range(end - first):
            top = list(zip(top_ids[i][:n], top_vals[i][:n]))
            entries.append(Logprob(targets[i], chosen[i], top, ranks[i]))
            i += 1
    return out
