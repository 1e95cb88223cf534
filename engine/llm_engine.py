"""The engine: schedule -> (draft) -> execute -> update, plus detokenization and stop strings.

Not thread-safe: one thread drives `step()`; workers put their own queue in front of it
(engine/engine_loop.py). Two exceptions, safe from any thread: `make_request` (tokenizer,
fixed sizes and a locked seed source) and `limits` (frozen sizes, the admission check)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, TypedDict

from engine.attention.selector import fused_kernels, make_attention_backend
from engine.checks import FieldError
from engine.config import EngineConfig, resolve_max_model_len
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import StepInput
from engine.extension import collective_rpc, load_extension
from engine.kv.block_manager import BlockManager
from engine.kv.kv_format import normalize as normalize_kv_dtype
from engine.kv.kv_pool import allocate_kv_pool, kv_block_bytes, num_blocks_for_budget, profile_peak
from engine.kv.kv_tier import HostTierStorage, KVTier, tier_slots
from engine.lifecycle import Lifecycle
from engine.lora.adapter import LoRAAdapter, LoRAError
from engine.lora.request import LoRARequest, lora_id_for
from engine.lora.slots import LoRACache, LoRASlots
from engine.models.config import ModelArgs
from engine.models.loader import LoadedModel, load_model
from engine.parallel.group import ParallelGroup
from engine.parallel.shard import TPShard
from engine.processing.deltas import Deltas
from engine.processing.generation_config import load_generation_config, sampling_defaults
from engine.processing.outputs import CompletionDelta
from engine.processing.request_builder import RequestBuilder
from engine.processing.tokens import Resume, SampledToken
from engine.runner.cuda_graphs import decode_graphs
from engine.runner.device import keep_freed_host_memory, resolve_device_dtype
from engine.runner.model_runner import ModelRunner
from engine.sampling.pooling import PoolingParams
from engine.sampling.sampling_params import SamplingParams
from engine.spec_decode.factory import make_proposer
from engine.spec_decode.proposer import Proposer
from engine.spec_decode.state import SpecState
from engine.structured.compile_process import CompileLimits


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    num_blocks: int
    num_free_blocks: int
    kv_usage: float  # share of blocks in use, 0..1
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which were cached
    num_preemptions: int
    prompt_tokens: int  # prompt tokens computed (excludes prefix hits and remote KV)
    generation_tokens: int
    queued_prefill_tokens: int  # prompt tokens admitted but not yet computed
    spec_num_drafts: int = 0  # verify steps with at least one draft token
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()  # accepted drafts by position 0..k-1
    kv_offload_blocks: int = 0  # blocks the second tier holds at most (0: off)
    kv_offload_blocks_used: int = 0
    kv_offload_hits: int = 0  # prompt tokens promoted from the tier (part of prefix_cache_hits)
    kv_offload_demotions: int = 0  # blocks copied pool -> tier
    kv_offload_promotions: int = 0  # blocks copied tier -> pool
    kv_offload_evictions: int = 0  # blocks the full tier dropped
    kv_offload_promote_s: float = 0.0  # mean seconds to promote one block (0: none yet)
    kv_offload_swap_outs: int = 0  # preempted requests whose partial blocks went to the tier
    kv_offload_swap_ins: int = 0  # resumed from them (those tokens not recomputed)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        parallel_group: ParallelGroup | None = None,
    ) -> None:
        """`parallel_group`: with tensor_parallel_size > 1, an existing group of that size to
        run on (not owned: `close` releases it, for the next engine); default: the engine
        starts and owns one (engine/parallel/group.py)."""
        self.config = config
        self.device, self.dtype = resolve_device_dtype(config)
        if self.device.type == "cpu":
            keep_freed_host_memory()
        self.parallel_group = self._start_group(config, loaded, parallel_group)
        try:
            self._build(config, loaded)
        except BaseException:
            self.close()  # the ranks stop (or, for a group passed in, wait for the next engine)
            raise

    def _build(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        """Everything but the tensor-parallel group: model, pool, scheduler, runner."""
        shard = (
            TPShard(0, config.tensor_parallel_size, config.enable_expert_parallel)
            if config.parallel
            else None
        )
        self.loaded = loaded or load_model(
            config.model, self.dtype, self.device, config.num_layers, shard=shard
        )
        if self.parallel_group is not None:
            # Rank 0's shard loaded: the split is valid, the other ranks load theirs.
            self.parallel_group.load(config)
            self.loaded.model.use_communicator(self.parallel_group.comm)
        self.tokenizer = self.loaded.tokenizer
        args = self.loaded.args
        self.max_model_len = resolve_max_model_len(
            config.max_model_len, args.max_position_embeddings
        )
        serve_positions = getattr(self.loaded.model, "serve_positions", None)
        if serve_positions is not None:  # the project's decoder (a plugin model: its own)
            serve_positions(self.max_model_len)
        self.backend = make_attention_backend(config.attention_backend, self.device)
        self.loaded.model.use_fused_kernels(fused_kernels(self.backend.name, self.device))
        # Not across tensor-parallel ranks (kv_cache_memory is required there): a rank-0
        # forward alone would wait on collectives no other rank joins.
        profile = self.device.type == "cuda" and not config.parallel
        peak = (
            profile_peak(
                self.loaded.model, self.backend, config, self.max_model_len, self.dtype, self.device
            )
            if profile
            else None
        )
        num_blocks = num_blocks_for_budget(config, args, self.dtype, self.device, peak)
        self.kv_cache = allocate_kv_pool(
            num_blocks, args, config.block_size, self.dtype, self.device, config.kv_cache_dtype
        )
        if self.parallel_group is not None:  # the same block ids on every rank
            self.parallel_group.allocate(num_blocks)
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            group_windows=_group_windows(args, config),
            tier=self._make_tier(args),
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            config.enable_chunked_prefill,
            config.max_loras if config.enable_lora else 0,
            config.long_prefill_token_threshold,
        )
        self.lora_cache: LoRACache | None = None
        lora_slots = None
        if config.enable_lora:
            self.lora_cache = LoRACache(
                args, config.max_lora_rank, config.max_cpu_loras or config.max_loras
            )
            lora_slots = LoRASlots(
                args, config.max_loras, config.max_lora_rank, self.dtype, self.device
            )
        self.limits = self.scheduler.limits
        """Fixed sizes and the admission check; safe from any thread."""
        self.runner = ModelRunner(
            self.loaded.model,
            self.kv_cache,
            self.backend,
            self.block_manager,
            lora_slots,
            self.parallel_group.send_step if self.parallel_group else None,
            decode_graphs(
                config,
                self.loaded.model,
                self.backend,
                self.kv_cache,
                self.block_manager.num_groups,
                self.max_model_len,
            ),
        )
        self.sampling_defaults = sampling_defaults(
            load_generation_config(config.generation_config, self.tokenizer.generation_config)
        )
        """SamplingParams fields -> the model's defaults (a request that omits one gets it)."""
        self._builder = RequestBuilder(
            self.tokenizer,
            args.vocab_size,
            self.max_model_len,
            config.block_size,
            config.seed,
            normalize_kv_dtype(config.kv_cache_dtype),
            CompileLimits(
                config.grammar_compile_timeout_s,
                config.grammar_compile_processes,
                config.max_grammar_bytes,
                config.max_grammar_repetitions,
                config.grammar_compile_wait_s,
            ),
        )
        self.deltas = Deltas(self.tokenizer, self.scheduler)
        self.weights_version = 0
        """Bumped by every weight update (`update_weights`, on the engine thread); part of
        every block hash (read once per request by `make_request`)."""
        for name, path in config.lora_modules:
            self.add_lora(LoRARequest(name, lora_id_for(name), path))
        spec = config.speculative_config
        self.proposer: Proposer | None = make_proposer(
            spec, self.loaded, self.runner, self.dtype, self.max_model_len, config.kv_cache_dtype
        )
        if config.kv_offloading_size and getattr(self.proposer, "owns_kv", False):
            raise FieldError(
                "kv_offloading_size",
                "kv_offloading_size: not supported with a "
                "separate draft model (its own KV pool is not offloaded); use "
                "speculative_config self:N or ngram",
            )
        self.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        """k: the most drafts a sequence verifies per step (0: no speculation)."""
        self.lifecycle = Lifecycle(
            self.loaded.model,
            self.kv_cache,
            self.scheduler,
            self.block_manager,
            lambda: load_model(config.model, self.dtype, self.device, config.num_layers).model,
            config.enable_sleep_mode,
            self.runner.graphs.drop if self.runner.graphs else None,
        )
        self.extension = load_extension(config.worker_extension_cls, self)
        """The worker extension (vLLM's `worker_extension_cls`, built as Class(engine) once the
        engine is complete): `collective_rpc` calls its methods first."""

    def _start_group(
        self, config: EngineConfig, loaded: LoadedModel | None, group: ParallelGroup | None
    ) -> ParallelGroup | None:
        """The tensor-parallel group (None at tensor_parallel_size 1)."""
        self._owns_group = False
        if not config.parallel:
            return None
        if loaded is not None:
            raise FieldError(
                "tensor_parallel_size",
                "tensor_parallel_size > 1 loads each rank's shard itself: pass no loaded model",
            )
        if self.device.type == "cuda" and config.kv_cache_memory is None:
            raise FieldError(
                "kv_cache_memory",
                "kv_cache_memory must be given with "
                "tensor_parallel_size > 1 on CUDA (no profiling forward across ranks yet)",
            )
        if group is None:
            group = ParallelGroup(
                config.tensor_parallel_size, config.distributed_timeout_s, self.device.type
            )
            self._owns_group = True
        elif group.size != config.tensor_parallel_size:
            raise ValueError(
                f"parallel group of {group.size} ranks for tensor_parallel_size "
                f"{config.tensor_parallel_size}"
            )
        return group

    def close(self) -> None:
        """Stop the tensor-parallel ranks (or, for a group passed in, release them for the
        next engine). Nothing to do at tensor_parallel_size 1."""
        group, self.parallel_group = self.parallel_group, None
        if group is not None:
            group.shutdown() if self._owns_group else group.release()

    def _make_tier(self, args: ModelArgs) -> KVTier | None:
        """The second KV tier `kv_offloading_size` asks for (None: off)."""
        config = self.config
        if not config.kv_offloading_size:
            return None
        block_bytes = kv_block_bytes(args, config.block_size, self.dtype, config.kv_cache_dtype)
        slots = tier_slots(config.kv_offloading_size, block_bytes)
        if slots < 1:
            raise FieldError(
                "kv_offloading_size",
                f"kv_offloading_size ({config.kv_offloading_size}"
                f" bytes) holds no {block_bytes}-byte KV block",
            )
        tier = KVTier(HostTierStorage(self.kv_cache, slots, config.kv_offloading_path))
        tier.measure()  # copy times for the swap-or-recompute choice (engine/core/swap_policy.py)
        return tier

    # ---- requests ------------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        resume: Resume | None = None,
        pooling: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Tokenize and validate; raises ValueError with a message naming the problem.
        Safe from any thread: touches no engine state (see RequestBuilder). `resume`: the
        request continues after outputs produced elsewhere (prefilled here with the prompt;
        counters, penalties, stop rules and seeded draws continue from them). `pooling`: a
        pooling (embedding) request: its one delta carries the embedding, no token.
        `lora_request`: the LoRA adapter to run with (loaded from its path here, off the
        engine thread, if not loaded yet; LoRAError if it cannot be used)."""
        return self._builder.build(
            request_id,
            prompt,
            params,
            cache_salt,
            priority,
            resume,
            pooling,
            self._lora(lora_request),
            self.weights_version,
        )

    # ---- LoRA adapters ------------------------------------------------------------------
    def _lora(self, request: LoRARequest | None) -> LoRAAdapter | None:
        if request is None:
            return None
        if self.lora_cache is None:
            raise LoRAError(
                f"LoRA adapter {request.lora_name!r} asked for, but LoRA is not "
                "enabled (--enable-lora)"
            )
        return self.lora_cache.get(request)

    def add_lora(self, request: LoRARequest) -> bool:
        """Load an adapter (vLLM's add_lora); raises LoRAError if it cannot be used."""
        return self._lora(request) is not None

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (requests running with it finish with it). Engine thread."""
        if self.lora_cache is None:
            return False
        self.runner.evict_lora(lora_id)
        return self.lora_cache.remove(lora_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.lora_cache.requests() if self.lora_cache is not None else []

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        pooling: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        return self.submit(
            self.make_request(
                request_id,
                prompt,
                params or SamplingParams(),
                cache_salt,
                priority,
                pooling=pooling,
                lora_request=lora_request,
            )
        )

    def submit(self, request: Request) -> Request:
        """Queue a request made by `make_request` (raises RequestRejected if it can never
        run, ValueError if its resume text does not match its outputs)."""
        detok = self.deltas.new_detokenizer(request)
        self._attach_spec(request)
        self.scheduler.add_request(request)
        self.deltas.track(request, detok)
        return request

    def _attach_spec(self, request: Request) -> None:
        spec = self.config.speculative_config
        if spec is not None and request.pooling is None and request.spec is None:
            request.spec = SpecState(spec.num_speculative_tokens, spec.adaptive)

    def abort_request(self, request_id: str) -> bool:
        """Abort every completion of the caller's request id; frees their blocks. Idempotent:
        False if nothing was live under that id."""
        found = False
        for rid in self.deltas.forget_group(request_id):
            found |= self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED) is not None
        return found

    # ---- decode worker: the prompt's KV is computed by a prefill worker -----------------
    def add_remote_prefill_request(self, request: Request) -> list[int] | None:
        """Allocate the prompt's blocks (reusing local prefix hits) and park the request until
        its KV arrives. Returns the block ids still to be filled (after the local hit), or
        None if it cannot be parked now (nothing changed; see
        Scheduler.allocate_for_remote_kv) or must prefill here (not
        `Request.remote_prefill_ok`)."""
        if not request.remote_prefill_ok:
            return None
        self._attach_spec(request)
        with self.block_manager.pool.copies_batched():
            block_ids = self.scheduler.allocate_for_remote_kv(request)
        if block_ids is not None:
            self.deltas.track(request)
        return block_ids

    def finish_remote_prefill(
        self, request_id: str, first_token: SampledToken
    ) -> list[CompletionDelta]:
        """Every prompt block has landed and the prefill worker sampled `first_token`."""
        return self.process_updates(
            [(self.scheduler.remote_kv_arrived(request_id, first_token), 1)]
        )

    def preview_remote_first(
        self, request: Request, first_token: SampledToken
    ) -> CompletionDelta | None:
        """The delta `finish_remote_prefill` will make first for this parked request, made
        now without changing anything, from any thread — so the token can be on its way
        before the next step boundary (engine/processing/deltas.py `Deltas.preview_first`;
        None for a request with a grammar)."""
        return self.deltas.preview_first(request, first_token)

    def has_schedulable_work(self) -> bool:
        """Something for `step()` to compute (requests parked for remote KV are not)."""
        return bool(self.scheduler.running or self.scheduler.waiting)

    # ---- stepping ------------------------------------------------------------------------
    def step(self, step: StepInput = StepInput()) -> list[CompletionDelta]:
        """One step, one way: schedule -> (draft) -> execute -> update_from_output. What
        each part learns travels in the step's input and outputs (SchedulerOutput, with
        the proposer's drafts; RunnerOutput, with the runner's time)."""
        # The step's tier copies: one gathered each way.
        with self.block_manager.pool.copies_batched():
            output = self.scheduler.schedule(step)
        self.runner.prepare(output)
        if self.proposer is not None:
            self.proposer.copy_blocks(output.block_copies)
            if output.speculating:
                output = output.with_drafts(self.proposer.propose(output.speculating))
        result = self.runner.execute(output)
        updated, finished = self.scheduler.update_from_output(output, result)
        got_tokens = {id(r) for r, _ in updated}
        return self.process_updates(updated + [(r, 0) for r in finished if id(r) not in got_tokens])

    def process_updates(self, updates: list[tuple[Request, int]]) -> list[CompletionDelta]:
        """The deltas of requests that got (n) new tokens or finished (0)
        (engine/processing/deltas.py)."""
        return self.deltas.build(updates)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        bm, pool, sched = self.block_manager, self.block_manager.pool, self.scheduler
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_waiting_for_kv=len(sched.waiting_for_kv),
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            kv_usage=pool.usage,
            prefix_cache_queries=bm.stats.queries,
            prefix_cache_hits=bm.stats.hits,
            num_preemptions=sched.stats.num_preemptions,
            prompt_tokens=sched.stats.prompt_tokens,
            generation_tokens=sched.stats.generation_tokens,
            queued_prefill_tokens=sum(
                r.num_prompt_tokens - r.num_computed_tokens
                for r in (*sched.waiting, *sched.running)
                if r.num_computed_tokens < r.num_prompt_tokens
            ),
            spec_num_drafts=sched.spec_stats.num_drafts,
            spec_num_draft_tokens=sched.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=sched.spec_stats.num_accepted_tokens,
            spec_accepted_per_pos=tuple(sched.spec_stats.accepted_per_pos)
            + (0,) * (self.num_speculative_tokens - len(sched.spec_stats.accepted_per_pos)),
            **_tier_stats(pool.tier),
        )

    def warm_up(self) -> None:
        """Run the model once on a short dummy prompt and a decode row before serving, so that
        the first request does not pay for first use (`ModelRunner.warm_up`); nothing else
        changes (no request, block, event or counter). Only before the first request."""
        self.runner.warm_up()

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    # ---- weights lifecycle (engine/lifecycle.py) -------------------------------------------
    def sleep(self, level: int = 1) -> None:
        self.lifecycle.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.lifecycle.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.lifecycle.level > 0

    def update_weights(self, weights) -> int:
        """Checkpoint-named (name, tensor) pairs, or a safetensors file / directory; returns
        how many weights were applied. Bumps the weights version and resets the prefix cache.
        Refused with tensor_parallel_size > 1 (the other ranks' shards would stay old)."""
        if self.config.parallel:
            raise RuntimeError(
                "update_weights is not supported with tensor_parallel_size > 1 "
                "(the other ranks' shards would not be updated)"
            )
        applied = self.lifecycle.update_weights(weights)
        self.weights_version += 1
        self.reset_prefix_cache()
        return applied

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list:
        return collective_rpc(self.extension, self, method, args, kwargs)


class _TierStats(TypedDict, total=False):
    """EngineStats' kv_offload_* fields (none without a tier)."""

    kv_offload_blocks: int
    kv_offload_blocks_used: int
    kv_offload_hits: int
    kv_offload_demotions: int
    kv_offload_promotions: int
    kv_offload_evictions: int
    kv_offload_swap_outs: int
    kv_offload_swap_ins: int
    kv_offload_promote_s: float


def _tier_stats(tier: KVTier | None) -> _TierStats:
    if tier is None:
        return {}
    s = tier.stats
    return _TierStats(
        kv_offload_blocks=tier.num_slots,
        kv_offload_blocks_used=tier.num_used,
        kv_offload_hits=s.hit_tokens,
        kv_offload_demotions=s.demotions,
        kv_offload_promotions=s.promotions,
        kv_offload_evictions=s.evictions,
        kv_offload_swap_outs=s.swap_outs,
        kv_offload_swap_ins=s.swap_ins,
        kv_offload_promote_s=tier.copy_times.load_s,
    )


def _group_windows(args: ModelArgs, config: EngineConfig) -> tuple[int | None, ...]:
    """Each KV group's window, past which its blocks are released (engine/kv/kv_groups.py) —
    none released (one full group) when a separate draft model reads the same block ids
    with attention of its own (make_proposer refuses that with several groups)."""
    groups = args.kv_groups()
    spec = config.speculative_config
    if (
        groups.num_groups == 1
        and spec is not None
        and spec.method != "ngram"
        and spec.self_draft_layers is None
    ):
        return (None,)
    return groups.windows
