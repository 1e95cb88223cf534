"""The LM head's own dtype reaches the sampler (engine/runner/model_runner.py, `head_logits`): a
bf16 model's batch where every row draws plainly is sampled from its bf16 logits with no
fp32 copy, any row that needs more (logprobs here) makes the step widen them, and the
tokens are the same either way."""

import pytest
import torch

from engine import LLM, SamplingParams, cpu_kernels
from engine.sampling.sampler import Sampler

pytestmark = pytest.mark.skipif(
    not cpu_kernels.load(), reason="no C++ toolchain for the CPU kernels"
)

_PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3,"]


def _generate(llm: LLM, params: list[SamplingParams], monkeypatch) -> tuple[list[list[int]], set]:
    seen = set()
    sample = Sampler.sample

    def spy(self, logits, rows, *args):
        seen.add(logits.dtype)
        return sample(self, logits, rows, *args)

    monkeypatch.setattr(Sampler, "sample", spy)
    outputs = llm.generate(_PROMPTS, params)
    monkeypatch.setattr(Sampler, "sample", sample)
    return [o.outputs[0].token_ids for o in outputs], seen


def test_plain_rows_sample_bf16_logits_and_the_same_tokens(monkeypatch):
    llm = LLM("default", num_layers=2, kv_cache_memory=64 << 20, dtype="bfloat16")
    params = [
        SamplingParams(temperature=t, seed=7, max_tokens=10, ignore_eos=True)
        for t in (0.0, 0.8, 1.0, 0.0)
    ]
    narrow, dtypes = _generate(llm, params, monkeypatch)
    assert dtypes == {torch.bfloat16}
    monkeypatch.setattr(Sampler, "reads_head_logits", lambda self, rows, device: False)
    wide, dtypes = _generate(llm, params, monkeypatch)
    assert dtypes == {torch.float32}
    assert narrow == wide
    monkeypatch.undo()
    with_logprobs = params[:3] + [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    ]
    tokens, dtypes = _generate(llm, with_logprobs, monkeypatch)
    assert dtypes == {torch.float32} and tokens == narrow
    assert llm.engine.block_manager.pool.num_free_blocks == llm.engine.block_manager.pool.num_blocks
