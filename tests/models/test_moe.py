"""SparseMoE (engine/models/moe.py) against transformers' own MixtralSparseMoeBlock and
Qwen3MoeSparseMoeBlock, against a per-token reference, through the fused Triton kernel; and
its checkpoint-name mapping against what transformers 5's save_pretrained writes."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import kernels
from engine.models.interface import ForwardContext
from engine.models.moe import SparseMoE, expert_weight_slot
from engine.models.registry import ModelRegistry

DIM, EXPERTS, TOP_K, INTER = 32, 4, 2, 24


def _ctx(fused: bool = False) -> ForwardContext:
    ctx = ForwardContext(None, None, None)
    ctx.kernels = kernels if fused else None
    return ctx


def _mixtral_config(**kw):
    return MixtralConfig(
        vocab_size=64,
        hidden_size=DIM,
        intermediate_size=INTER,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        **kw,
    )


def _qwen3_moe_config(**kw):
    return Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=DIM,
        intermediate_size=64,
        moe_intermediate_size=INTER,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        **kw,
    )


def _hf_block(arch: str, norm_topk_prob: bool, impl: str, seed: int = 0):
    if arch == "mixtral":
        config, block_cls = _mixtral_config(), MixtralSparseMoeBlock
    else:
        config, block_cls = _qwen3_moe_config(norm_topk_prob=norm_topk_prob), Qwen3MoeSparseMoeBlock
    config._experts_implementation = impl
    block = block_cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return block


def _ours(arch: str, norm_topk_prob: bool, hf_block) -> SparseMoE:
    moe = SparseMoE(
        DIM,
        EXPERTS,
        TOP_K,
        INTER,
        renormalize=arch == "mixtral" or norm_topk_prob,
        layer=0,
        round_routing_weights=arch == "qwen3_moe",
    )
    # transformers 5 keeps the experts stacked in memory: the fused names.
    with torch.no_grad():
        for name, tensor in hf_block.state_dict().items():
            moe.weight_target(name).copy_(tensor)
    return moe


def _tokens(num_tokens: int, few_experts: bool, hf_block, dtype=torch.float32):
    x = torch.randn(num_tokens, DIM, generator=torch.Generator().manual_seed(num_tokens))
    if few_experts:  # push every token towards expert 1's router row: few experts get work
        x = x * 0.1 + 3 * hf_block.gate.weight[1].detach()
    return x.to(dtype)


def _per_token(moe: SparseMoE, x):
    """One token, one chosen expert at a time, straight from the HF formula (fp32)."""
    probs = torch.softmax(moe.gate(x).float(), dim=-1)
    weights, ids = probs.topk(moe.top_k, dim=-1)
    if moe.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(moe.top_k):
            e = int(ids[t, k])
            gate, up = (moe.w13[e] @ x[t]).split([moe.inter, moe.inter])
            out[t] += weights[t, k] * (moe.w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


CASES = [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)]


@pytest.mark.parametrize("arch,norm_topk_prob", CASES)
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("num_tokens,few_experts", [(1, False), (7, False), (64, False), (9, True)])
@torch.no_grad()
def test_matches_transformers_block(arch, norm_topk_prob, impl, num_tokens, few_experts):
    hf = _hf_block(arch, norm_topk_prob, impl)
    moe = _ours(arch, norm_topk_prob, hf)
    x = _tokens(num_tokens, few_experts, hf)
    if few_experts:
        assert len(moe.gate(x).topk(TOP_K, dim=-1).indices.unique()) < EXPERTS
    expected = hf(x[None])[0]
    torch.testing.assert_close(moe(x, _ctx()), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(moe(x, _ctx()), _per_token(moe, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch,norm_topk_prob", CASES)
@torch.no_grad()
def test_bf16_close_to_transformers(arch, norm_topk_prob):
    hf = _hf_block(arch, norm_topk_prob, "eager").to(torch.bfloat16)
    moe = _ours(arch, norm_topk_prob, hf).to(torch.bfloat16)
    x = _tokens(33, False, hf, torch.bfloat16)
    out = moe(x, _ctx())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, hf(x[None])[0], atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("arch,norm_topk_prob", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_fused_kernel_path_matches_torch_path(arch, norm_topk_prob, dtype):
    hf = _hf_block(arch, norm_topk_prob, "eager")
    moe = _ours(arch, norm_topk_prob, hf).to(dtype)
    x = _tokens(17, False, hf, dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(moe(x, _ctx(fused=True)), moe(x, _ctx()), **tol)


def test_empty_batch():
    moe = _ours("mixtral", True, _hf_block("mixtral", True, "eager"))
    assert moe(torch.zeros(0, DIM), _ctx()).shape == (0, DIM)


# ---- checkpoint names ----


def _saved(tmp_path, arch, **save_kw):
    torch.manual_seed(0)
    model = (
        MixtralForCausalLM(_mixtral_config())
        if arch == "mixtral"
        else Qwen3MoeForCausalLM(_qwen3_moe_config(norm_topk_prob=True))
    )
    model.save_pretrained(tmp_path, **save_kw)
    return model, load_file(str(tmp_path / "model.safetensors"))


def _engine_model(model, tensors):
    """The engine's class for the transformers model, loaded from its saved tensors (the
    path every checkpoint takes: DecoderLM.load_weights -> SparseMoE.weight_target)."""
    config = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    ours = ModelRegistry.resolve(config["architectures"][0]).from_config(config)
    ours.load_weights(tensors.items())
    return ours


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("original_format", [True, False])
def test_saved_checkpoint_round_trips(tmp_path, arch, original_format):
    model, tensors = _saved(tmp_path, arch, save_original_format=original_format)
    block = "block_sparse_moe" if arch == "mixtral" and original_format else "mlp"
    names = set(tensors)
    if original_format:  # what transformers 5.24 writes by default: per-expert tensors
        down = "w2" if arch == "mixtral" else "down_proj"
        assert f"model.layers.1.{block}.experts.3.{down}.weight" in names
        assert not any("gate_up_proj" in n for n in names)
    else:
        assert f"model.layers.1.{block}.experts.gate_up_proj" in names
    assert f"model.layers.0.{block}.gate.weight" in names
    ours = _engine_model(model, tensors)
    for layer, block in enumerate(ours.layers):
        moe, hf = block.mlp, model.model.layers[layer].mlp
        assert torch.equal(moe.gate.weight, hf.gate.weight)
        assert torch.equal(moe.w13, hf.experts.gate_up_proj)
        assert torch.equal(moe.w2, hf.experts.down_proj)


def test_update_one_expert_in_place(tmp_path):
    model, tensors = _saved(tmp_path, "mixtral")
    ours = _engine_model(model, tensors)
    moe = ours.layers[0].mlp
    before = moe.w13.detach().clone()
    target = moe.weight_target("experts.2.w3.weight")  # Mixtral w3 = up rows of expert 2
    assert target.data_ptr() == moe.w13[2, INTER].data_ptr() and target.shape == (INTER, DIM)
    name = "model.layers.0.block_sparse_moe.experts.2.w3.weight"
    assert ours.update_weights([(name, torch.ones(INTER, DIM))]) == 1
    assert (moe.w13[2, INTER:] == 1).all()
    assert torch.equal(moe.w13[2, :INTER], before[2, :INTER]) and torch.equal(
        moe.w13[:2], before[:2]
    )


def test_names_and_slots():
    assert expert_weight_slot("experts.5.gate_proj.weight", 8) == ("w13", 5, slice(0, 8))
    assert expert_weight_slot("experts.5.w3.weight", 8) == ("w13", 5, slice(8, 16))
    assert expert_weight_slot("experts.5.down_proj.weight", 8) == ("w2", 5, None)
    assert expert_weight_slot("experts.down_proj", 8) == ("w2", None, None)
    with pytest.raises(KeyError):
        expert_weight_slot("experts.5.w4.weight", 8)


def test_load_refuses_missing_unknown_and_misshapen(tmp_path):
    model, tensors = _saved(tmp_path, "qwen3_moe")
    up = "model.layers.0.mlp.experts.3.up_proj.weight"

    def load(changed):
        config = {**model.config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
        ModelRegistry.resolve("Qwen3MoeForCausalLM").from_config(config).load_weights(
            changed.items()
        )

    with pytest.raises(KeyError, match=r"no checkpoint tensor for layers\.0\.mlp\.w13"):
        load({n: t for n, t in tensors.items() if n != up})
    with pytest.raises(KeyError, match=r"no checkpoint tensor for layers\.0\.mlp\.gate"):
        load({n: t for n, t in tensors.items() if n != "model.layers.0.mlp.gate.weight"})
    with pytest.raises(KeyError, match=r"experts\.4\.up_proj"):  # E = 4
        load({**tensors, "model.layers.0.mlp.experts.4.up_proj.weight": torch.zeros(INTER, DIM)})
    with pytest.raises(KeyError, match="has shape"):
        load({**tensors, up: torch.zeros(INTER + 1, DIM)})
