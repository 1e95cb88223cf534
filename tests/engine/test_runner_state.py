"""What the model runner keeps across steps (the sampler's penalty counts, mean-pooling sums)
is keyed by request id and dropped when the request leaves: finished, aborted or preempted.
Nothing of it lives on the Request."""

from engine import LLM, PoolingParams, SamplingParams

NUM_LAYERS = 2
BLOCK_BYTES = NUM_LAYERS * 2 * 16 * 3 * 64 * 4  # one 16-token fp32 block of SmolLM2's KV
PENALIZED = dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.2, ignore_eos=True)


def _engine(model_dir, **kwargs):
    return LLM(str(model_dir), num_layers=NUM_LAYERS, dtype="float32", **kwargs).engine


def test_state_of_finished_and_aborted_requests_is_dropped(model_dir):
    engine = _engine(model_dir, kv_cache_memory=64 << 20, max_num_batched_tokens=64)
    counts, partial = engine.runner.sampler.penalties.counts, engine.runner.pooler.partial
    engine.add_request("long", list(range(100, 120)), SamplingParams(max_tokens=30, **PENALIZED))
    engine.add_request("short", list(range(200, 210)), SamplingParams(max_tokens=2, **PENALIZED))
    engine.step()
    assert counts.keys() == {"long", "short"}
    while "short" in engine.scheduler.requests:
        engine.step()
    engine.add_request(
        "mean", list(range(300, 400)), SamplingParams(max_tokens=1), pooling=PoolingParams("mean")
    )
    engine.step()  # the finished request leaves; the embedding is part of the way in
    assert counts.keys() == {"long"} and partial.keys() == {"mean"}
    assert engine.abort_request("long") and engine.abort_request("mean")
    engine.step()  # nothing to compute: the aborted requests' state goes all the same
    assert not counts and not partial and not engine.has_unfinished_requests()


def test_state_of_a_preempted_request_is_dropped_and_rebuilt(model_dir):
    # Four blocks for two 20-token prompts growing by 40 tokens: one of them is preempted.
    engine = _engine(model_dir, kv_cache_memory=4 * BLOCK_BYTES)
    counts = engine.runner.sampler.penalties.counts
    prepare, preempted = engine.runner.prepare, []

    def checked_prepare(output):
        had = {r.request_id for r in output.preempted if r.request_id in counts}
        prepare(output)
        preempted.extend(had)
        assert not any(r.request_id in counts for r in output.preempted)

    engine.runner.prepare = checked_prepare
    for rid, start in (("a", 100), ("b", 200)):
        engine.add_request(
            rid, list(range(start, start + 20)), SamplingParams(max_tokens=40, **PENALIZED)
        )
    tokens = {"a": [], "b": []}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
    assert engine.stats().num_preemptions > 0 and preempted  # it had counts, and lost them
    engine.step()
    assert not counts
    alone = _engine(model_dir, kv_cache_memory=64 << 20)  # rebuilt counts: the same tokens
    for rid, start in (("a", 100), ("b", 200)):
        alone.add_request(
            rid,
            list(range(start, start + 20)),
            SamplingParams(max_tokens=len(tokens[rid]), **PENALIZED),
        )
    expected = {"a": [], "b": []}
    while alone.has_unfinished_requests():
        for delta in alone.step():
            expected[delta.request_id] += delta.token_ids
    assert tokens == expected
