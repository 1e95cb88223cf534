"""bf16 projections from oneDNN-packed weights (engine/models/layers.py `pack_linears`):
bit-identical to F.linear for decode batches up to 32 rows, within one bf16 rounding of it up
to PACKED_MAX_ROWS, rebuilt when a weight changes in place,
and the engine's greedy tokens and logprobs are the same with and without them."""

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.models.layers import (
    PACKED_MAX_ROWS,
    Linear,
    PackedWeight,
    bf16_packing_supported,
    pack_linears,
)

packing = pytest.mark.skipif(
    not bf16_packing_supported(),
    reason="no native bf16 on this CPU (AVX2, or AVX-512 without BF16)",
)


def _linear(out_features=96, in_features=64, bias=True):
    layer = Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features))
        if bias:
            layer.bias.copy_(torch.randn(out_features))
    layer.packed = PackedWeight()
    return layer


@packing
@pytest.mark.parametrize("rows", [1, 3, 16, 32, PACKED_MAX_ROWS + 1, 600])
@torch.inference_mode()
def test_equals_f_linear(rows):
    """Decode batches up to 32 rows: bit-identical; past PACKED_MAX_ROWS F.linear itself."""
    layer = _linear()
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@packing
@pytest.mark.parametrize("rows", [33, 64, PACKED_MAX_ROWS])
@torch.inference_mode()
def test_larger_batches_round_like_f_linear(rows):
    """33..PACKED_MAX_ROWS rows (packed, summed in other blocks): each output is F.linear's or
    its bf16 neighbour, and no further from the fp32 product than F.linear's."""
    layer = _linear(out_features=576, in_features=1536, bias=False)
    x = torch.randn(rows, 1536, dtype=torch.bfloat16)
    ours, theirs = layer(x).float(), F.linear(x, layer.weight).float()
    exact = x.float() @ layer.weight.float().t()
    ulp = theirs.abs().clamp(min=1e-30) * 2.0**-7  # bf16: 8 significant bits
    assert ((ours - theirs).abs() <= ulp).all()
    assert (ours - exact).abs().max() <= (theirs - exact).abs().max() * 1.01 + 1e-6


@packing
@torch.inference_mode()
def test_repacked_after_an_in_place_update_and_a_move():
    layer = _linear(bias=False)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    layer(x)
    layer.weight[:10].mul_(-2.0)  # a fused projection's row range, updated in place
    assert torch.equal(layer(x), F.linear(x, layer.weight))
    layer.weight.data = torch.randn(96, 64, dtype=torch.bfloat16)  # replaced (sleep / wake)
    assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_off_where_onednn_has_no_bf16(monkeypatch):
    """An AVX2-only CPU: packing stays off (packing a bf16 weight would raise there)."""
    layer = Linear(8, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert not pack_linears(layer) and layer.packed is None


def test_only_bf16_on_cpu():
    layer = Linear(8, 8, dtype=torch.float32)
    assert not pack_linears(layer) and layer.packed is None


@packing
def test_engine_outputs_unchanged():
    llm = LLM("default", num_layers=2, kv_cache_memory=64 << 20, dtype="bfloat16")
    model = llm.engine.loaded.model
    assert model.lm_head_packed is not None  # the runner turned packing on
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run():
        llm.reset_prefix_cache()
        return [
            (o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in llm.generate(prompts, params, use_tqdm=False)
        ]

    packed = run()
    pack_linears(model, False)
    assert run() == packed
