"""What a worker publishes of its load and speed (`Capacity`, in its etcd registration and
`Worker.Status`): from the latest engine stats snapshot and the engine loop's step timings —
measured, never assumed; 0 until measured. The router places and sizes requests with it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.registration import Capacity

if TYPE_CHECKING:
    from engine.engine_loop import EngineLoop
    from engine.llm_engine import EngineStats, LLMEngine
    from worker_runtime.pull_cost import PullCost


def capacity_of(
    engine: LLMEngine, stats: EngineStats, loop: EngineLoop, pull_cost: PullCost
) -> Capacity:
    """The `Capacity` a worker publishes now."""
    prefill, decode = loop.prefill_steps, loop.decode_steps
    # In token blocks (what the router sizes a prompt in): a token block takes a block in each
    # KV group (engine/kv/kv_groups.py) — at most; sliding groups give theirs back. The second
    # tier too: it holds one slot per (group, block).
    groups = engine.limits.kv_groups
    caps = (engine.scheduler.long_prefill_token_threshold, loop.prompt_cap)
    return Capacity(
        total_blocks=stats.num_blocks // groups,
        free_blocks=stats.num_free_blocks // groups,
        running=stats.num_running + stats.num_waiting_for_kv,
        waiting=stats.num_waiting,
        queued_prefill_tokens=stats.queued_prefill_tokens,
        prefill_tokens_per_s=prefill.prompt_tokens_per_s,
        decode_step_s=decode.seconds,
        decode_step_tokens=decode.tokens,
        prefill_step_s=prefill.seconds,
        prefill_step_tokens=prefill.tokens,
        max_num_batched_tokens=engine.config.max_num_batched_tokens,
        long_prefill_token_threshold=min([c for c in caps if c], default=0),
        kv_offload_total_blocks=stats.kv_offload_blocks // groups,
        kv_offload_used_blocks=stats.kv_offload_blocks_used // groups,
        kv_promote_s_per_block=stats.kv_offload_promote_s,
        kv_pull_blocks_per_s=pull_cost.blocks_per_s,
        kv_pull_overhead_s=pull_cost.overhead_s,
    )
