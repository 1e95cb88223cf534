"""Factories for engine unit tests: requests, block managers, schedulers, and a hand-driven
step that stands in for the model (vLLM tests/v1/core style)."""

from __future__ import annotations

import itertools

from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import RunnerOutput, SchedulerOutput, StepInput
from engine.kv.block_hash import compute_block_hashes, hash_extras
from engine.kv.block_manager import BlockManager
from engine.processing.tokens import SampledToken
from engine.sampling.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(
    tokens: list[int] | int,
    block_size: int = 4,
    max_tokens: int = 8,
    cache_salt: str | None = None,
    n: int = 1,
    request_id: str | None = None,
    priority: int = 0,
) -> Request:
    token_ids = list(range(100, 100 + tokens)) if isinstance(tokens, int) else list(tokens)
    return Request(
        request_id=request_id or f"req-{next(_ids)}",
        prompt_token_ids=token_ids,
        sampling=SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0),
        seed=0,
        eos_token_ids=frozenset({2}),
        max_tokens=max_tokens,
        block_hashes=compute_block_hashes(token_ids, block_size, cache_salt),
        hash_extras=hash_extras(cache_salt),
        cache_salt=cache_salt,
        priority=priority,
    )


def make_requests(lengths: list[int], block_size: int = 4, max_tokens: int = 8) -> list[Request]:
    return [make_request(n, block_size, max_tokens) for n in lengths]


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    group_windows: tuple[int | None, ...] = (None,),
) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching, group_windows=group_windows)
    return Scheduler(
        bm, max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill
    )


def fake_model_output(output: SchedulerOutput, token: int = 7) -> RunnerOutput:
    """What a model would sample: one token for each request that computed all its known
    tokens this step (n tokens when it is due to fork)."""
    sampled = {}
    for request, n in output.scheduled:
        if request.num_computed_tokens + n == request.num_tokens:
            count = request.sampling.n if request.pending_forks else 1
            sampled[request.request_id] = [SampledToken(token)] * count
    return RunnerOutput(sampled)


def step(scheduler: Scheduler, token: int = 7, inputs: StepInput = StepInput()) -> SchedulerOutput:
    output = scheduler.schedule(inputs)
    scheduler.update_from_output(output, fake_model_output(output, token))
    return output


def drain(scheduler: Scheduler, max_steps: int = 10_000) -> int:
    """Step until nothing is left; returns the number of steps."""
    for steps in range(1, max_steps + 1):
        step(scheduler)
        if not scheduler.has_unfinished():
            return steps
    raise AssertionError("scheduler did not drain")
