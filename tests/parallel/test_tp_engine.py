"""The engine at tensor_parallel_size 2 (two processes, gloo on the CPU) against the same
engine at 1: greedy tokens equal, logprobs close, for a dense model, other families, MoE
(tensor- and expert-parallel) and KV heads fewer than ranks. One process group serves every
case (module-scoped), each engine loading its model's shards on it in turn."""

import pytest

from engine import LLM, SamplingParams
from engine.parallel.group import ParallelGroup

SHARED = "You are a careful assistant. Answer briefly and never invent facts. The user asks:"
PROMPTS = ["Hi there", f"{SHARED} What is 2+2?", f"{SHARED} Name a color of the sky."]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
ENGINE = dict(dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=16)
"""16-token steps: the prompts prefill in chunks, sharing steps with decodes."""


@pytest.fixture(scope="module")
def group():
    g = ParallelGroup(2, timeout_s=30.0)
    yield g
    g.shutdown()


def run(path, group=None, warm_up=False, **extra):
    llm = LLM(str(path), parallel_group=group, **ENGINE, **extra)
    try:
        if warm_up:
            llm.engine.warm_up()
        return [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.close()


@pytest.mark.parametrize(
    "arch,ep,kv",
    [
        ("llama-9q3kv", False, "auto"),
        ("qwen3", False, "auto"),
        ("gemma3", False, "auto"),
        ("llama-kv1", False, "auto"),
        ("qwen3-moe", False, "auto"),
        ("qwen3-moe", True, "auto"),
        ("llama-9q3kv", False, "int8"),
    ],
)
def test_tp2_matches_tp1(tiny_model, group, arch, ep, kv):
    """`kv`: the KV cache dtype (int8: each rank's pool quantizes its own heads)."""
    path = tiny_model(arch)
    want = run(path, kv_cache_dtype=kv)
    got = run(path, group, tensor_parallel_size=2, enable_expert_parallel=ep, kv_cache_dtype=kv)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert len(g.logprobs) == len(w.logprobs)
        for lw, lg in zip(w.logprobs, g.logprobs):
            assert lg.logprob == pytest.approx(lw.logprob, abs=1e-4)
            assert [t for t, _ in lg.top] == [t for t, _ in lw.top]
            assert [v for _, v in lg.top] == pytest.approx([v for _, v in lw.top], abs=1e-4)


def test_group_is_reused_and_survives_a_refused_engine(tiny_model, group):
    """A config refused at start never reaches the ranks; an engine that fails after the
    ranks loaded releases them; the group serves the next engine."""
    with pytest.raises(
        ValueError, match="enable_lora is not supported with tensor_parallel_size > 1"
    ):
        LLM(
            str(tiny_model("llama-9q3kv")),
            parallel_group=group,
            tensor_parallel_size=2,
            enable_lora=True,
            **ENGINE,
        )
    with pytest.raises(ValueError, match="holds no"):
        LLM(
            str(tiny_model("llama-9q3kv")),
            parallel_group=group,
            tensor_parallel_size=2,
            **{**ENGINE, "kv_cache_memory": 1024},
        )
    assert run(tiny_model("llama-kv1"), group, tensor_parallel_size=2)


def test_forks_speculation_and_refused_weight_updates(tiny_model, group):
    """n=2 seeded samples (their shared partial block is copied on write: every rank copies
    its heads) and ngram speculation give TP=1's tokens; update_weights is refused."""
    path = str(tiny_model("llama-9q3kv"))
    forks = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    want, got = [], []
    for out, extra in ((want, {}), (got, dict(tensor_parallel_size=2, parallel_group=group))):
        llm = LLM(path, speculative_config=spec, **ENGINE, **extra)
        try:
            for o in llm.generate(PROMPTS, forks, use_tqdm=False):
                out.append(sorted(c.token_ids for c in o.outputs))
            out.append(
                [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
            )
            if extra:
                with pytest.raises(RuntimeError, match="update_weights is not supported"):
                    llm.update_weights([])
        finally:
            llm.close()
    assert got == want


def test_one_group_per_process(group):
    from engine.parallel.group import ParallelGroup

    with pytest.raises(RuntimeError, match="already runs a tensor-parallel group"):
        ParallelGroup(2)


def test_tp2_warm_up_reaches_every_rank(tiny_model, group):
    """A worker's warm-up forwards run on every rank (the collectives line up) and change no
    token."""
    path = tiny_model("llama-9q3kv")
    want = [o.token_ids for o in run(path)]
    assert [o.token_ids for o in run(path, group, warm_up=True, tensor_parallel_size=2)] == want
