"""Flattens a scheduled step into one ragged batch, runs the model, samples.

The runner owns the KV pool and the attention backend; it never decides policy: the
scheduler says which requests compute how many tokens, the runner lays them out (one-token
rows first, see AttentionMetadata) and samples where a request has computed all its known
tokens.

A request asking for prompt logprobs also gets logits at each prompt position it runs (chunk
by chunk). A pooling request (engine/sampling/pooling.py) gets the final-normed hidden state, no
logits, at the rows it pools and never samples. Everyone else only gets logits where it
samples. What a step computed comes back as one RunnerOutput; the runner never writes a
request. What it keeps across steps (the sampler's penalty counts, mean-pooling sums) is
keyed by request id and dropped when the scheduler says a request left (`prepare`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from engine.attention import AttentionBackend
from engine.core.request import Request
from engine.core.scheduler_output import RunnerOutput, SchedulerOutput
from engine.kv.block_manager import BlockManager
from engine.lora.batch import LoRABatch
from engine.lora.slots import LoRASlots
from engine.models.interface import CausalLM, ForwardContext
from engine.models.layers import pack_linears
from engine.parallel.step import GroupArrays, StepInputs, copy_blocks, forward
from engine.processing.tokens import Logprob, SampledToken
from engine.runner.cuda_graphs import DecodeGraphs
from engine.runner.pooler import Pooler
from engine.runner.step_layout import StepLayout, build_layout, slots_of
from engine.sampling.sample_row import SampleRow
from engine.sampling.sampler import Sampler, raw_logprobs, token_ranks, with_logprobs
from engine.spec_decode.verify import accepted_prefix, rejection_sample


class _Forward(NamedTuple):
    """What one forward returned: the final hidden states and context (None: a CUDA graph
    replayed the step), the logits rows (None: no LM head) and whether those are the LM
    head's own dtype."""

    x: torch.Tensor | None
    ctx: ForwardContext | None
    logits: torch.Tensor | None
    head_logits: bool


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
        all-decode steps (engine/runner/cuda_graphs.py; never with `send_step`)."""
        if graphs is not None and send_step is not None:
            raise ValueError("CUDA graphs replay one rank's forward: not with tensor parallelism")
        self.model = model
        self.send_step = send_step
        self.graphs = graphs
        assert isinstance(model, nn.Module)  # every CausalLM is one (engine/models/interface.py)
        pack_linears(model)  # bf16 on the CPU: decode-sized projections from packed weights
        self.lora_slots = lora_slots
        self.kv_cache = kv_cache
        self.backend = backend
        self.bm = block_manager
        self.block_size = kv_cache.shape[4]
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
        """The step's forward and draws (after `prepare`): lay the step out, run the forward,
        collect what it computed, with the runner's wall time (`RunnerOutput.seconds`)."""
        if not output.scheduled:
            return RunnerOutput()
        t0 = time.perf_counter()
        self.has_run = True
        layout = build_layout(output, self.bm, self.pooler)
        result = self._collect(layout, self._forward(layout))
        result.seconds = time.perf_counter() - t0
        return result

    def _forward(self, layout: StepLayout) -> _Forward:
        """Run the model over the step (a captured CUDA graph replays an all-decode step),
        with logits only at the rows that need them (`StepInputs.logits_rows`)."""
        step = layout.inputs
        if self.send_step is not None:
            self.send_step(step)
        lora = self._lora_batch(layout.order)
        if self.graphs is not None and layout.all_decode and lora is None:
            logits = self.graphs.logits(step)  # None: this step runs eagerly
            if logits is not None:
                return _Forward(None, None, logits, False)
        # The LM head's own dtype where the sampler reads it so (no fp32 copy of the logits).
        head = (
            bool(layout.sample_rows)
            and not layout.prompt_rows
            and not layout.verify
            and self.sampler.reads_head_logits(layout.sample_rows, self.device)
        )
        x, ctx, logits = forward(self.model, self.backend, self.kv_cache, step, lora, head)
        return _Forward(x, ctx, logits, head)

    def _collect(self, layout: StepLayout, ran: _Forward) -> RunnerOutput:
        """What the forward computed, by request: embeddings, prompt logprobs, draws (logits
        rows: the sample rows, then the prompt-logprob rows)."""
        result = RunnerOutput()
        if layout.pool_spans:
            result.pooled = self._pool(layout, ran)
        if ran.logits is None:
            return result
        num_samples = len(layout.sample_at)
        if layout.prompt_spans:
            result.prompt_logprobs = _prompt_logprobs(ran.logits[num_samples:], layout.prompt_spans)
        if num_samples:
            result.sampled = self._sample(ran.logits[:num_samples], layout, ran.head_logits)
        return result

    def _pool(self, layout: StepLayout, ran: _Forward) -> dict[str, list[float]]:
        """The embeddings of pooling requests whose prompt this step completed."""
        assert ran.x is not None and ran.ctx is not None  # pooling steps never replay a graph
        hidden = self.model.hidden(ran.x, ran.ctx, self._index(layout.pool_rows)).float()
        pooled: dict[str, list[float]] = {}
        parts = hidden.split([count for _, count in layout.pool_spans])
        for (request, _), part in zip(layout.pool_spans, parts):
            embedding = self.pooler.add(request, part)
            if embedding is not None:
                pooled[request.request_id] = embedding
        return pooled

    def _sample(
        self,
        logits: torch.Tensor,
        layout: StepLayout,
        plainly: bool,
    ) -> dict[str, list[SampledToken]]:
        """Draw every row; a request with drafts keeps what verification accepts
        (engine/spec_decode/verify.py) plus the target's token. `plainly`: the sampler said
        it reads these rows' logits as the LM head made them."""
        rows = layout.sample_rows
        tokens = self._draw(
            logits, rows, {i for v in layout.verify if v.probs is not None for i in v.rows}, plainly
        )
        out: dict[str, list[SampledToken]] = {}
        for v in layout.verify:
            span = slice(v.rows.start, v.rows.stop)
            if v.probs is not None:
                kept = self._rejection_sample(logits[span], rows[span], v.drafts, v.probs)
            else:
                drawn = [t for t in tokens[span] if t is not None]
                kept = drawn[: accepted_prefix([t.token_id for t in drawn], v.drafts) + 1]
            out[v.request.request_id] = kept
        verified = {i for v in layout.verify for i in v.rows}
        for i, (row, token) in enumerate(zip(rows, tokens)):
            if i not in verified and token is not None:
                out.setdefault(row.request.request_id, []).append(token)
        return out

    def _draw(
        self, logits: torch.Tensor, rows: list[SampleRow], q_rows: set[int], plainly: bool
    ) -> list[SampledToken | None]:
        """Each row's draw, except the rows of drafts that came with their distributions
        (`q_rows`: None there; rejection sampling draws them)."""
        if not q_rows:  # the usual step: every row samples at once (a view, no copy)
            return list(self.sampler.sample(logits, rows, plainly or None))
        plain = [i for i in range(len(rows)) if i not in q_rows]
        tokens: list[SampledToken | None] = [None] * len(rows)
        for i, token in zip(plain, self.sampler.sample(logits[plain], [rows[i] for i in plain])):
            tokens[i] = token
        return tokens

    @torch.inference_mode()
    def warm_up(self, prompt_len: int = 32) -> None:
        """Before the first request: a forward of one `prompt_len`-token prompt, then one of a
        decode row, each with the LM head (on every rank), so that the first request does not
        pay for first use — oneDNN primitives, kernels, the thread pool, first allocations:
        100-250 ms of a first 256-token prefill on a 2-core CPU. Their K/V land in the pool's
        first blocks, which is only harmless while no block holds anything (a request writes
        a block before it reads it, and none is cached yet): refused after that. With CUDA
        graphs, every decode size is captured here too (engine/runner/cuda_graphs.py)."""
        if self.has_run or self.bm.pool.num_free_blocks < self.bm.pool.num_blocks:
            raise RuntimeError("warm_up: only before the first request")
        prompt_len = max(1, min(prompt_len, self.bm.pool.num_blocks * self.block_size))
        table = list(range(-(-prompt_len // self.block_size)))
        positions = np.arange(prompt_len)
        for rows in (positions, positions[-1:]):  # the prompt; its next token's decode row
            slots = slots_of(table, rows, self.block_size)
            step = StepInputs(
                np.zeros(len(rows), dtype=np.int64),
                rows.astype(np.int64),
                [GroupArrays.build([slots], [table]) for _ in range(self.bm.num_groups)],
                [len(rows)],
                [int(rows[-1]) + 1],
                np.array([len(rows) - 1]),
            )
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
        assert self.lora_slots is not None  # the engine admits adapters only with slots
        slot_of = self.lora_slots.prepare(adapters)
        row_slots = [
            slot_of[r.lora.lora_int_id] if r.lora is not None else -1
            for r, n in order
            for _ in range(n)
        ]
        return LoRABatch.build(self.lora_slots, row_slots, self.device, self.model.kernels)

    def evict_lora(self, lora_id: int) -> None:
        if self.lora_slots is not None:
            self.lora_slots.evict(lora_id)

    def _index(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _rejection_sample(
        self, logits: torch.Tensor, rows: list[SampleRow], drafts: list[int], q: torch.Tensor
    ) -> list[SampledToken]:
        """Drafts that came with their distributions `q`: the standard min(1, p/q) rule."""
        raw_idx, raw = raw_logprobs(logits, rows)
        kept = rejection_sample(self.sampler.target_probs(logits, rows), q, drafts, rows)
        n = len(kept)
        return with_logprobs(
            kept, rows[:n], ([i for i in raw_idx if i < n], None if raw is None else raw[:n])
        )


def _prompt_logprobs(
    logits: torch.Tensor, spans: list[tuple[Request, int, int]]
) -> dict[str, list[Logprob]]:
    """`logits`: one row per prompt position of `spans` (request, first, end), in order;
    a Logprob for prompt tokens first + 1 .. end of each request, by request id."""
    logprobs = logits.log_softmax(-1)
    targets = [t for req, first, end in spans for t in req.prompt_token_ids[first + 1 : end + 1]]
    chosen_t = logprobs.gather(1, torch.tensor(targets, device=logits.device)[:, None])
    ranks = token_ranks(logprobs, chosen_t).tolist()
    chosen: list[float] = chosen_t.squeeze(1).tolist()
    asked = [req.sampling.prompt_logprobs or 0 for req, _, _ in spans]  # spans all ask
    top_vals, top_ids = (t.tolist() for t in logprobs.topk(max(asked)))
    out: dict[str, list[Logprob]] = {}
    i = 0
    for (req, first, end), n in zip(spans, asked):
        entries: list[Logprob] = []
        out[req.request_id] = entries
        for _ in range(end - first):
            top = list(zip(top_ids[i][:n], top_vals[i][:n]))
            entries.append(Logprob(targets[i], chosen[i], top, ranks[i]))
            i += 1
    return out
