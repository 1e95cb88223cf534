"""Continuous-batching scheduler: one token budget per step over running and waiting requests.

Each step gives every running request what it still lacks (one token when decoding, a chunk
when prefilling), then admits waiting requests while budget, `max_num_seqs` and blocks last.
A prefill chunk is also capped at `long_prefill_token_threshold` tokens when that is set
(vLLM's knob): a long prompt then takes many small steps, so the decodes that share those
steps keep their inter-token latency.
Both queues are kept in (priority, arrival) order, lower first (vLLM's priority policy; with
every priority 0 it is first come, first served). When a running request cannot get a block,
the last running request in that order is preempted (its blocks freed; it is recomputed
later, mostly from the prefix cache; with a KV tier its partial last block may be swapped
out and back instead, engine/core/swap_policy.py) and waits again in its place in that order. The
scheduler never touches tensors; it is the one writer of a running request's progress and
results: the model runner's RunnerOutput comes back through `update_from_output`.
"""

from __future__ import annotations

import dataclasses
from bisect import insort

from engine.core.limits import EngineLimits
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import RunnerOutput, SchedulerOutput, SchedulerStats, StepInput
from engine.core.step_cost import LONG_PREFILL_CHUNKS, even_chunk
from engine.core.swap_policy import SwapPolicy
from engine.kv.block_manager import BlockManager
from engine.processing.tokens import Logprob, SampledToken
from engine.spec_decode.scheduling import SpeculationScheduling
from engine.spec_decode.stats import SpecDecodeStats

__all__ = ["Scheduler", "SchedulerOutput", "SchedulerStats"]


class Scheduler(SpeculationScheduling):
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        max_loras: int = 0,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        self.bm = block_manager
        self.long_prefill_token_threshold = (
            long_prefill_token_threshold if enable_chunked_prefill else 0
        )
        """Most prompt tokens one request computes in one step (0: the step budget only)."""
        self.max_loras = max_loras  # distinct LoRA adapters per step (0: LoRA off)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked = enable_chunked_prefill
        self.limits = EngineLimits(
            max_model_len,
            block_manager.block_size,
            block_manager.pool.num_blocks,
            max_num_batched_tokens,
            enable_chunked_prefill,
            block_manager.group_windows,
        )
        self.waiting: list[Request] = []  # both in _order
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[
            str
        ] = []  # since the last schedule (SchedulerOutput.finished_req_ids)
        self.stats = SchedulerStats()
        self.spec_stats = SpecDecodeStats()
        tier = block_manager.pool.tier
        self.swap_policy = SwapPolicy(tier.copy_times if tier is not None else None)
        """Whether a preempted request's partial block is swapped out (its prefill rate is
        learnt from the runner's step times, in `update_from_output`)."""

    # ---- admission -----------------------------------------------------------------------
    def check_fits(self, request: Request) -> None:
        """Raise RequestRejected if the request could never be scheduled (a resumed one
        prefills its earlier outputs too)."""
        self.limits.check_fits(request.num_tokens)

    def add_request(self, request: Request) -> None:
        self.check_fits(request)
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        insort(self.waiting, request, key=_order)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self, step: StepInput = StepInput()) -> SchedulerOutput:
        """This step's requests and token counts; `step.prompt_token_budget` paces prompts."""
        budget = self.max_num_batched_tokens
        # Prefill chunks (more than one new token) also draw on this; decodes never do.
        pace = step.prompt_token_budget if self.chunked else 0
        paced = pace > 0
        prompt_budget = pace if paced else budget
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        finished: list[Request] = []
        speculating: list[tuple[Request, int]] = []
        loras: set[int] = set()  # adapters this step runs: at most max_loras

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if not self._lora_fits(request, loras):
                i += 1  # held back: its adapter would be one too many this step
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            n = min(self._chunk(remaining), budget)
            if remaining > 1 and paced:  # a paced prefill chunk
                held = self._held_by_long(remaining, pace)
                n = min(n, even_chunk(remaining, pace - held), prompt_budget - held)
                if n <= 0:  # this step's prefill share is spent: it continues next step
                    i += 1
                    continue
            k = self._num_drafts(request, budget) if n == 1 == remaining else 0
            n += k
            while not self.bm.append_slots(request, n):
                if k:  # short of blocks: drafts go before anyone is preempted
                    n, k = n - k, 0
                    continue
                if len(self.running) == 1:
                    # Alone and still out of blocks: the pool cannot hold this sequence any
                    # longer; preempting it would only loop. (Its prompt always fits.)
                    self.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
                    finished.append(request)
                    break
                # The last in (priority, arrival) order; never one already scheduled (those
                # are before i).
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, n))
                self._use_lora(request, loras)
                if k:
                    speculating.append((request, k))
                elif remaining > 1:
                    prompt_budget -= n
                budget -= n
                i += 1
                continue
            break

        j = 0
        while (
            j < len(self.waiting)
            and budget > 0
            and not preempted
            and len(self.running) + len(self.waiting_for_kv) < self.max_num_seqs
        ):
            request = self.waiting[j]
            if request.num_output_tokens >= request.max_tokens:
                # Resumed with every output it may have (only its end was lost elsewhere):
                # nothing to compute; it ends "length" (with any text still held back).
                self.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
                finished.append(request)
                continue
            if not self._lora_fits(request, loras):
                j += 1
                continue
            prefix = self.bm.match_prefix(request)
            new = request.num_tokens - prefix.num_tokens
            n = self._chunk(new)
            limit = min(budget, prompt_budget) if n > 1 else budget  # n > 1: a prefill chunk
            if n > limit:
                if not self.chunked or limit <= 0:
                    break
                n = min(n, even_chunk(new, pace), limit) if paced else limit
            if not self.bm.allocate(request, n, prefix):
                break
            del self.waiting[j]
            self._use_lora(request, loras)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = prefix.num_tokens
            request.num_computed_tokens = prefix.num_tokens
            request.status = RequestStatus.RUNNING
            insort(self.running, request, key=_order)
            scheduled.append((request, n))
            budget -= n
            if n > 1:
                prompt_budget -= n

        left, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled,
            self.bm.take_copies(),
            preempted,
            finished,
            speculating,
            finished_req_ids=left,
        )

    def _chunk(self, num_new_tokens: int) -> int:
        """A request's tokens this step before the budget: capped by the long-prefill
        threshold (a decode's single token never is)."""
        cap = self.long_prefill_token_threshold
        return cap if 0 < cap < num_new_tokens else num_new_tokens

    def _held_by_long(self, remaining: int, pace: int) -> int:
        """What a running prefill with `remaining` tokens leaves of the prompt budget `pace`
        (a paced prompt's chunk is `remaining` in even chunks of at most `pace` less this,
        engine/core/step_cost.py `even_chunk`; what is left of this step's budget caps it
        further; paced, that share is > 0) to the
        other prompts: half when it is long and another prompt waits or is part-way through
        its prefill (a long prompt must not hold up every short one that arrives meanwhile),
        else nothing (a prompt a few chunks from done goes first: first come, first served)."""
        if remaining <= LONG_PREFILL_CHUNKS * pace:
            return 0
        others = len(self.waiting) + sum(
            r.num_tokens - r.num_computed_tokens > 1 for r in self.running
        )
        return pace // 2 if others > 1 else 0  # others counts this one

    def _lora_fits(self, request: Request, loras: set[int]) -> bool:
        return (
            request.lora is None or request.lora.lora_int_id in loras or len(loras) < self.max_loras
        )

    @staticmethod
    def _use_lora(request: Request, loras: set[int]) -> None:
        if request.lora is not None:
            loras.add(request.lora.lora_int_id)

    def _preempt(self, request: Request) -> None:
        """Free the request to wait again; it recomputes from its longest cached prefix, or
        from where it was if its partial block was swapped out (not for requests that need
        every position computed: prompt logprobs, pooling)."""
        partial = request.num_computed_tokens % self.bm.block_size
        if (
            request.pooling is None
            and not request.computes_whole_prompt
            and self.swap_policy.swap(partial, self.bm.num_groups)
        ):
            self.bm.swap_out(request)
        else:
            self.bm.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if request.spec is not None:
            request.spec.num_draft_computed = 0
        self.stats.num_preemptions += 1
        insort(self.waiting, request, key=_order)

    def update_from_output(
        self, output: SchedulerOutput, result: RunnerOutput
    ) -> tuple[list[tuple[Request, int]], list[Request]]:
        """Apply what the runner computed for `output`: counters advance, sampled tokens are
        appended under the stop rules (a verify result keeps its accepted drafts), prompt
        logprobs are appended, and a pooling request finishes with its embedding once its
        prompt is computed. Returns ((request, new tokens) for requests that got tokens,
        including new forks; requests that finished, including those the scheduler stopped
        without a new token). A measured step that computed prompt tokens feeds the swap
        policy its prefill rate."""
        updated: list[tuple[Request, int]] = []
        finished: list[Request] = list(output.finished)
        sampled = result.sampled
        if result.seconds is not None and any(
            r.num_computed_tokens < r.num_prompt_tokens for r, _ in output.scheduled
        ):
            self.swap_policy.observe_prefill(result.seconds, output.num_batched_tokens)
        for request, k in output.speculating:
            if request.request_id in output.drafts:
                self._take_drafts(request, k, output.drafts[request.request_id])
        for request_id, entries in result.prompt_logprobs.items():
            self.requests[request_id].prompt_logprobs.extend(entries)
        for request, n in output.scheduled:
            if request.status is not RequestStatus.RUNNING:
                continue  # finished or aborted meanwhile
            if drafts := output.drafts_of(request):
                kept = self._apply_verified(request, drafts, sampled[request.request_id])
                updated.append((request, kept))
                if request.status.is_finished:
                    finished.append(request)
                continue
            if request.num_computed_tokens < request.num_prompt_tokens:
                self.stats.prompt_tokens += min(
                    n, request.num_prompt_tokens - request.num_computed_tokens
                )
            request.num_computed_tokens += n
            self.bm.cache_full_blocks(request)
            if request.pooling is not None:
                if request.num_computed_tokens == request.num_tokens:  # pooled: done
                    request.embedding = result.pooled[request.request_id]
                    self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                    finished.append(request)
                continue
            tokens = sampled.get(request.request_id)
            if not tokens:
                continue  # mid-prefill chunk
            group = [request] + [self._fork(request, i) for i in range(1, len(tokens))]
            for member, token in zip(group, tokens):
                self._append(member, token)
                updated.append((member, 1))
                if member.status.is_finished:
                    finished.append(member)
        return updated, finished

    def _fork(self, parent: Request, index: int) -> Request:
        """Completion `index` of `parent` (sampling n > 1), at the same point: every field is
        the parent's (`dataclasses.replace`, so a new field is never forgotten) except the
        identity and the per-completion state listed here. Invariant: no list is shared
        with the parent (each is copied or starts empty): a new list field goes here."""
        child = dataclasses.replace(
            parent,
            request_id=f"{parent.request_id}#{index}",
            completion_index=index,
            parent_id=parent.request_id,
            status=RequestStatus.RUNNING,
            block_hashes=list(parent.block_hashes),
            token_ids=list(parent.token_ids),
            spec=parent.spec.fresh() if parent.spec is not None else None,
            grammar=parent.grammar.fork() if parent.grammar is not None else None,
            # Per-completion results and placement start empty (the block manager's `fork`
            # fills the tables; completion 0 alone carries the prompt logprobs).
            logprobs=[],
            prompt_logprobs=[],
            stop_reason=None,
            block_tables=[],
            keep_blocks_from=None,
            remote_skip_blocks=None,
            resume=None,
            embedding=None,
        )
        self.bm.fork(parent, child)
        self.requests[child.request_id] = child
        insort(self.running, child, key=_order)
        return child

    def _append(self, request: Request, token: SampledToken) -> None:
        status = self._append_token(request, token)
        if status is not None:
            self.finish_request(request.request_id, status)

    def _append_token(self, request: Request, token: SampledToken) -> RequestStatus | None:
        """Append one output token (and its logprobs); the status it stops the request
        with, if any (the caller finishes it)."""
        request.append_token(token.token_id)
        self.stats.generation_tokens += 1
        if token.logprob is not None:
            request.logprobs.append(
                Logprob(token.token_id, token.logprob, list(token.top_logprobs), token.rank)
            )
        if request.grammar is not None and not request.grammar.accept(token.token_id):
            return RequestStatus.FINISHED_ERROR  # cannot happen: the sampler masks the rest
        status = self._stop_status(request, token.token_id)
        if status is None and request.grammar is not None and request.grammar.terminated:
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete
        return status

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        status, stop_token = stop_status(
            request, token_id, request.num_output_tokens, request.num_tokens, self.max_model_len
        )
        if stop_token is not None:
            request.stop_reason = stop_token
        return status

    # ---- finishing -----------------------------------------------------------------------
    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (stop, abort, error) a request in any state, freeing its blocks. Idempotent."""
        assert status.is_finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._finished_ids.append(request_id)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_KV:
            del self.waiting_for_kv[request_id]
        request.status = status
        self.bm.free(request)  # its blocks, or what it swapped out while preempted
        return request

    # ---- decode worker: KV computed elsewhere -------------------------------------------
    def allocate_for_remote_kv(self, request: Request) -> list[int] | None:
        """Allocate a prompt's blocks, reusing local prefix hits, and park the request as
        WAITING_FOR_KV. Returns the block ids a prefill worker must fill: every KV group's
        after its `Request.remote_skip_blocks` (the local hit; for a sliding group only the
        blocks the first decode step reads), group after group. None if `max_num_seqs` requests are
        already running or parked or the pool cannot hold the prompt now (nothing changed; the
        decode worker then prefills it itself, releasing as it goes)."""
        self.check_fits(request)
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if len(self.running) + len(self.waiting_for_kv) >= self.max_num_seqs:
            return None
        prefix = self.bm.match_prefix(request)
        # Per group, what the prefill worker does not fill: the local hit, and for a sliding
        # group also what the first decode step (at num_tokens) no longer reads.
        bs, n = self.bm.block_size, request.num_tokens
        hit = prefix.num_tokens // bs
        skips = [
            hit if w is None else max(hit, min(self.bm.blocks_for(n) - 1, (n - w + 1) // bs))
            for w in self.bm.group_windows
        ]
        if not self.bm.allocate(
            request, n - prefix.num_tokens, prefix, first_query=n, keep_from=skips
        ):
            return None
        request.remote_skip_blocks = skips
        request.num_cached_tokens = prefix.num_tokens
        request.status = RequestStatus.WAITING_FOR_KV
        self.requests[request.request_id] = request
        self.waiting_for_kv[request.request_id] = request
        tables = self.bm.block_tables(request.request_id)
        return [b for table, skip in zip(tables, skips) for b in table[skip:]]

    def remote_kv_arrived(self, request_id: str, first_token: SampledToken) -> Request:
        """All of the prompt's KV has landed and the prefill worker sampled `first_token`:
        the prompt counts as computed and the request joins the running batch."""
        request = self.waiting_for_kv.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        insort(self.running, request, key=_order)
        self.bm.cache_full_blocks(request)
        self._append(request, first_token)
        return request

    # ---- state ---------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.requests)


def stop_status(
    request: Request, token_id: int, num_output_tokens: int, num_tokens: int, max_model_len: int
) -> tuple[RequestStatus | None, int | None]:
    """vLLM's check_stop for `token_id` appended as output number `num_output_tokens`
    (`num_tokens` in all): length first; no EOS / stop token before min_tokens (the sampler
    masks them, this is a guard); EOS before stop_token_ids (only the latter is a stop
    reason, returned second). Reads the request, changes nothing: any thread may ask."""
    params = request.sampling
    if num_output_tokens >= request.max_tokens or num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    if num_output_tokens < params.min_tokens:
        return None, None
    if not params.ignore_eos and token_id in request.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED, None
    if token_id in params.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED, token_id
    return None, None


def _order(request: Request) -> tuple[int, float]:
    """Queue order: lower priority value first, then earlier arrival."""
    return request.priority, request.arrival_time
