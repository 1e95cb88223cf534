"""Prefill chunks paced beside running decodes: the scheduler's per-step prompt budget, the
cap that keeps a step within an inter-token latency target (engine/core/step_cost.py), and the
engine loop applying it from its own measured step costs."""

import time

import pytest
from engine_factories import drain, make_request, step

from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import StepInput
from engine.core.step_cost import (
    StepCost,
    even_chunk,
    fitted_slope,
    prompt_token_cap,
    step_cost_from,
)
from engine.kv.block_manager import BlockManager

NUM_LAYERS = 2


def _scheduler(budget: int = 64) -> Scheduler:
    return Scheduler(
        BlockManager(256, 4, True),
        max_num_seqs=16,
        max_num_batched_tokens=budget,
        max_model_len=1024,
    )


def _paced_chunks(s: Scheduler, decodes, a, b, until, budget: int) -> list[tuple[int, int]]:
    """(a's, b's) prompt tokens of each step until `until()` (b None: 0), each step under
    prompt budget `budget`; checks every decode runs in every step and the prompts keep to
    the budget together."""
    seen = []
    while not until():
        out = step(s, inputs=StepInput(prompt_token_budget=budget))
        scheduled = {r.request_id: n for r, n in out.scheduled}
        assert all(scheduled[r.request_id] == 1 for r in decodes)  # every decode, every step
        chunk = lambda r: n if r and (n := scheduled.get(r.request_id, 0)) > 1 else 0  # noqa: E731
        seen.append((chunk(a), chunk(b)))
        assert sum(seen[-1]) <= budget
    return seen


def _decoding(num: int) -> tuple[Scheduler, list]:
    """A scheduler with `num` short requests decoding."""
    s = _scheduler()
    decodes = [make_request(4, max_tokens=60) for _ in range(num)]
    for r in decodes:
        s.add_request(r)
    step(s)
    return s, decodes


def test_prompt_budget_caps_all_chunks_of_a_step_together_and_never_a_decode():
    s, decodes = _decoding(3)
    a = make_request(list(range(1000, 1030)), max_tokens=2)
    b = make_request(list(range(2000, 2030)), max_tokens=2)
    s.add_request(a)
    s.add_request(b)
    seen = _paced_chunks(s, decodes, a, b, lambda: b.num_output_tokens > 0, 12)
    # Short prompts go first come, first served, each in the fewest even chunks the budget
    # allows (30 = 3 x 10, not 12 + 12 + 6); b gets what a leaves of each step.
    assert seen == [(10, 2), (10, 2), (10, 2), (0, 12), (0, 12)], seen
    c = make_request(list(range(3000, 3100)), max_tokens=1)
    s.add_request(c)
    out = step(s, inputs=StepInput(prompt_token_budget=0))  # off: the step budget alone
    decoding = [r for r, n in out.scheduled if r is not c]
    assert all(n == 1 for r, n in out.scheduled if r is not c)
    assert dict((r.request_id, n) for r, n in out.scheduled)[c.request_id] == 64 - len(decoding)
    drain(s)


def test_a_long_paced_prompt_leaves_half_the_budget_to_the_prompts_behind_it():
    s, decodes = _decoding(2)
    a = make_request(list(range(1000, 1100)), max_tokens=2)  # 9 chunks: long
    s.add_request(a)
    assert _paced_chunks(s, decodes, a, None, lambda: a.num_computed_tokens > 0, 12) == [(12, 0)]
    b = make_request(list(range(2000, 2030)), max_tokens=2)
    s.add_request(b)
    seen = _paced_chunks(s, decodes, a, b, lambda: b.num_output_tokens > 0, 12)
    # a keeps half of every step while b waits and while b prefills; b is not held up by
    # a's 76 tokens still to go.
    assert seen == [(6, 6)] * 5, seen
    assert a.num_computed_tokens == 12 + 30
    drain(s)


def test_even_chunks():
    assert even_chunk(256, 150) == 128  # two of 128, not 150 + 106
    assert even_chunk(256, 100) == 86  # three: 86 + 86 + 84
    assert even_chunk(30, 12) == 10
    assert even_chunk(12, 12) == 12 and even_chunk(5, 12) == 5
    assert even_chunk(13, 12) == 7


def test_step_cost_fit_and_the_cap_it_gives():
    assert fitted_slope(0.05, 8, 0.55, 108) == pytest.approx(0.005)
    assert fitted_slope(0.05, 8, 0.06, 20) is None  # too close to tell a slope from noise
    assert fitted_slope(0.0, 0, 0.5, 100) is None  # decode steps not measured
    cost = step_cost_from(0.05, 8, 0.55, 108, 0.005)
    assert cost == StepCost(pytest.approx(0.01), 0.005)
    # 0.2 s target beside 8 decodes: (0.2 - 0.01 - 0.04) / 0.005 = 30 tokens.
    assert prompt_token_cap(cost, 8, 0.2, floor=16, budget=512) == 30
    # One decode: 1 token fits the target, 9 make the 3/4 share; never below one block.
    assert prompt_token_cap(cost, 1, 0.02, floor=16, budget=512) == 16
    assert prompt_token_cap(cost, 8, 60.0, floor=16, budget=512) == 512  # never past the budget
    # 100 decodes take 0.51 s of a step already: the chunk still gets three times as long
    # (306 tokens), so prefill keeps at least 3/4 of a busy engine's time; with prompts queued
    # behind it, 4/5 (one queued) and 5/6 (two): a backlog drains.
    assert prompt_token_cap(cost, 100, 0.2, floor=16, budget=512) == 306
    assert prompt_token_cap(cost, 100, 0.2, floor=16, budget=512, queued=1) == 408
    assert abs(prompt_token_cap(cost, 100, 0.2, floor=16, budget=512, queued=2) - 510) <= 1
    assert prompt_token_cap(cost, 100, 0.2, floor=16, budget=64, queued=2) == 64
    # 8 decodes (0.05 s): the target's 30 tokens are also the 3/4 share; one prompt queued
    # raises the share to 4/5 (40 tokens) past the target.
    assert prompt_token_cap(cost, 8, 0.2, floor=16, budget=512, queued=1) == 40


def test_engine_loop_paces_a_long_prompt_beside_decodes(model_dir):
    from engine.config import EngineConfig
    from engine.engine_loop import INITIAL_PROMPT_CAP_BLOCKS, EngineLoop
    from engine.llm_engine import LLMEngine
    from engine.sampling.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            num_layers=NUM_LAYERS,
            dtype="float32",
            kv_cache_memory=64 << 20,
            max_num_batched_tokens=512,
        )
    )
    chunks: list[tuple[int, int, int]] = []  # (prompt tokens, decodes, budget) of mixed steps
    inner = engine.scheduler.schedule

    def recording_schedule(inputs: StepInput = StepInput()):
        out = inner(inputs)
        prompt = sum(n for _, n in out.scheduled if n > 1)
        decodes = sum(1 for _, n in out.scheduled if n == 1)
        if prompt and decodes:
            chunks.append((prompt, decodes, inputs.prompt_token_budget))
        return out

    engine.scheduler.schedule = recording_schedule
    loop = EngineLoop(engine, lambda deltas: None, itl_target_s=0.05)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    loop.start()
    try:
        for i in range(4):
            loop.call(lambda e, i=i: e.add_request(f"d{i}", [200 + i] * 8, params)).result(30)
        time.sleep(0.5)  # the short prompts are decoding
        for i in range(3):
            prompt = [1000 + (i * 977 + j) % 9000 for j in range(600)]
            loop.call(
                lambda e, i=i, p=prompt: e.add_request(
                    f"long{i}", p, SamplingParams(temperature=0.0, max_tokens=1)
                )
            ).result(30)
        deadline = time.monotonic() + 120
        while loop.call(lambda e: e.has_unfinished_requests()).result(30):
            assert time.monotonic() < deadline, "requests did not finish in time"
            time.sleep(0.05)
    finally:
        loop.stop()
    assert chunks, "no step mixed a prompt chunk with decodes"
    block = engine.config.block_size
    # Every mixed step kept to the budget the loop set; the first one to the initial cap.
    assert all(0 < prompt <= budget for prompt, _, budget in chunks)
    assert chunks[0][2] == INITIAL_PROMPT_CAP_BLOCKS * block
    # Once measured, the cap comes from the fitted step cost, not the initial guess.
    d, p = loop.decode_steps, loop.prefill_steps
    slope = fitted_slope(d.seconds, d.tokens, p.seconds, p.tokens)
    assert slope is not None
    expected = prompt_token_cap(
        step_cost_from(d.seconds, d.tokens, p.seconds, p.tokens, slope), 1, 0.05, block, 512
    )
    assert loop._prompt_cap(1) == expected
    assert any(budget != chunks[0][2] for _, _, budget in chunks)
