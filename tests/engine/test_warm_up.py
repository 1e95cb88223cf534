"""`LLMEngine.warm_up` (what a worker runs on its engine thread before it registers): it
leaves no trace — every block free and unhashed, no KV event, no counter — the engine then
generates exactly what a fresh one does (the dummy K/V in the first blocks is never read),
and it is refused once a request has run."""

import pytest

from engine import LLM, SamplingParams

PROMPTS = ["The capital of France is", "The capital of France is a city", "def add(a, b):"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _llm() -> LLM:
    return LLM("default", num_layers=2, kv_cache_memory=32 << 20, enable_prefix_caching=True)


def test_warm_up_leaves_no_trace_and_changes_no_token():
    fresh = [o.outputs[0].token_ids for o in _llm().generate(PROMPTS, PARAMS, use_tqdm=False)]
    llm = _llm()
    engine = llm.engine
    engine.warm_up()
    bm = engine.block_manager
    assert bm.pool.num_free_blocks == bm.pool.num_blocks
    assert all(block.block_hash is None for block in bm.pool.blocks)
    assert not bm.pool.take_events()
    stats = engine.stats()
    assert (stats.prompt_tokens, stats.generation_tokens, stats.prefix_cache_queries) == (0, 0, 0)
    assert not engine.has_unfinished_requests()
    warmed = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert warmed == fresh
    with pytest.raises(RuntimeError, match="only before the first request"):
        engine.warm_up()
