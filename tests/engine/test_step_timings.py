"""The step timings a worker publishes for placement (engine/engine_loop.py StepTimings ->
cluster.registration.Capacity via WorkerRuntime.capacity) are measured from its own steps:
exponentially weighted means over recent steps of each kind, zero until measured."""

import time
from unittest import mock

import pytest

from cluster.grpc_security import OPEN
from engine.engine_loop import STEP_EWMA_WEIGHT, StepTimings

NUM_LAYERS = 2


def test_step_timings_skip_warm_up_then_weight_recent_steps():
    t = StepTimings().added(5.0, 100, 90)  # warm-up: left out
    assert (t.steps, t.seconds, t.prompt_tokens_per_s) == (0, 0.0, 0.0)
    t = t.added(0.2, 40, 32)
    assert (t.steps, t.seconds, t.tokens, t.prompt_tokens) == (1, 0.2, 40, 32)
    assert t.prompt_tokens_per_s == pytest.approx(160.0)
    t = t.added(0.4, 40, 32)
    assert t.seconds == pytest.approx(0.2 + STEP_EWMA_WEIGHT * 0.2)
    for _ in range(200):
        t = t.added(1.0, 10, 0)
    assert (t.seconds, t.tokens, t.prompt_tokens) == pytest.approx((1.0, 10, 0), abs=1e-6)


def test_a_worker_publishes_its_measured_step_timings(model_dir):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling.sampling_params import SamplingParams
    from kvtransfer import FakeFabric, FakeTransferBackend, KVTransferConfig
    from worker_runtime.args import WorkerConfig
    from worker_runtime.runtime import WorkerRuntime

    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            num_layers=NUM_LAYERS,
            dtype="float32",
            kv_cache_memory=32 << 20,
            max_num_batched_tokens=64,
            long_prefill_token_threshold=32,
        )
    )
    # Time every step from outside the loop, with what it computed.
    observed: list[tuple[float, int]] = []  # (seconds, prompt tokens)
    inner_step = engine.step

    def timed_step(*step_input):
        before = engine.scheduler.stats.prompt_tokens
        t0 = time.perf_counter()
        deltas = inner_step(*step_input)
        observed.append((time.perf_counter() - t0, engine.scheduler.stats.prompt_tokens - before))
        return deltas

    engine.step = timed_step
    runtime = WorkerRuntime(
        WorkerConfig(role="decode", etcd="unused:0"),
        engine,
        FakeTransferBackend(FakeFabric(), KVTransferConfig(agent_name="w")),
        lambda info: mock.AsyncMock(),
        auth=OPEN,
        metrics=mock.MagicMock(),
    )
    loop = runtime.loop
    fresh = runtime.capacity()
    assert (fresh.prefill_tokens_per_s, fresh.decode_step_s, fresh.prefill_step_s) == (0, 0, 0)
    assert (fresh.max_num_batched_tokens, fresh.long_prefill_token_threshold) == (64, 32)

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    loop.start()
    try:
        for i, length in enumerate([8, 10, 200, 150]):  # two short, then two long prompts
            prompt = [100 + (i * 211 + j) % 5000 for j in range(length)]
            loop.call(lambda e, i=i, p=prompt: e.add_request(f"r{i}", p, params)).result(30)
        deadline = time.monotonic() + 120
        while loop.call(lambda e: e.has_unfinished_requests()).result(30):
            assert time.monotonic() < deadline, "requests did not finish in time"
            time.sleep(0.05)
        runtime.stats = loop.call(lambda e: e.stats()).result(30)
    finally:
        loop.stop()

    cap = runtime.capacity()
    prefill = [dt for dt, prompt in observed if prompt]
    decode = [dt for dt, prompt in observed if not prompt]
    assert loop.prefill_steps.steps == len(prefill) - 1 >= 5  # 368 tokens, <= 64 a step
    assert loop.decode_steps.steps == len(decode) - 1 >= 5
    # Means of the steps measured (after the first of each kind): within what was observed.
    assert min(prefill[1:]) * 0.9 <= cap.prefill_step_s <= max(prefill[1:]) * 1.1
    assert min(decode[1:]) * 0.9 <= cap.decode_step_s <= max(decode[1:]) * 1.1
    assert 1 <= cap.decode_step_tokens <= 4
    assert 1 <= cap.prefill_step_tokens <= 64  # within the step budget
    assert cap.prefill_tokens_per_s == pytest.approx(
        loop.prefill_steps.prompt_tokens / loop.prefill_steps.seconds
    )
    # The recent rate agrees in magnitude with the worker's whole-life prefill rate.
    lifetime = runtime.stats.prompt_tokens / loop.prefill_seconds
    assert lifetime / 4 < cap.prefill_tokens_per_s < lifetime * 4
    assert cap.queued_prefill_tokens == 0 and cap.running == 0
