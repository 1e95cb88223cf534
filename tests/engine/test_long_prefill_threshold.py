"""`long_prefill_token_threshold` (vLLM's knob): no request computes more prompt tokens than
that in one step, so a long prompt prefilled beside running decodes takes many short steps
and every decode still gets its token each step."""

import argparse

import pytest
from engine_factories import drain, make_request, step

from engine.config import EngineConfig, add_engine_args
from engine.core.scheduler import Scheduler
from engine.kv.block_manager import BlockManager


def _scheduler(threshold: int, budget: int = 64, chunked: bool = True) -> Scheduler:
    return Scheduler(
        BlockManager(256, 4, True),
        max_num_seqs=16,
        max_num_batched_tokens=budget,
        max_model_len=1024,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=threshold,
    )


def test_long_prompt_is_chunked_at_the_threshold_beside_running_decodes():
    s = _scheduler(threshold=16)
    decodes = [make_request(4, max_tokens=30) for _ in range(3)]
    for r in decodes:
        s.add_request(r)
    step(s)  # the three short prompts (4 tokens each, under the threshold)
    long = make_request(list(range(1000, 1100)), max_tokens=2)  # no prefix shared
    s.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        before = {r.request_id: r.num_output_tokens for r in decodes}
        out = step(s)
        scheduled = dict((r.request_id, n) for r, n in out.scheduled)
        chunks.append(scheduled[long.request_id])
        assert all(scheduled[r.request_id] == 1 for r in decodes)  # decodes keep flowing
        assert all(r.num_output_tokens == before[r.request_id] + 1 for r in decodes)
    # 64 - 3 decodes would allow 61 a step; the threshold holds it to 16.
    assert chunks == [16] * 6 + [4]
    drain(s)


def test_waiting_prompts_are_capped_too_and_zero_means_the_budget_only():
    s = _scheduler(threshold=8)
    a, b = make_request(20), make_request(20)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()  # both admitted in one step, 8 tokens each
    assert [n for _, n in out.scheduled] == [8, 8]
    s = _scheduler(threshold=0)
    s.add_request(make_request(100))
    assert [n for _, n in s.schedule().scheduled] == [64]


def test_threshold_is_a_config_flag_and_needs_chunked_prefill():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--long-prefill-token-threshold", "256"])
    assert EngineConfig.from_args(args).long_prefill_token_threshold == 256
    assert EngineConfig().long_prefill_token_threshold == 0
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        EngineConfig(long_prefill_token_threshold=8, enable_chunked_prefill=False)
    assert _scheduler(threshold=8, chunked=False).long_prefill_token_threshold == 0
