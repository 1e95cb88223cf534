"""Every built-in architecture against transformers' own class, on tiny random 2-layer
checkpoints in float32: prefill logits, and greedy tokens and their logprobs through the
engine with chunked prefill (16-token chunks), a pool small enough to preempt, prompts longer
than the sliding window (8 tokens) and prefix-cache hits on a second pass.

The bundled model lends its tokenizer; the weights are drawn here, biases and norm weights
included (transformers initialises those to 0 and 1, which would hide a mapping mistake)."""

import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import AttentionMetadata, TorchAttentionBackend
from engine.kv.kv_pool import allocate_kv_pool, kv_block_bytes
from engine.models.interface import ForwardContext
from engine.models.loader import load_model

SHARED = "You are a careful assistant. Answer briefly and never invent facts. The user asks:"
PROMPTS = [
    "Hi there",
    f"{SHARED} What is 2+2?",
    f"{SHARED} Name a color of the sky.",
    f"{SHARED} Who wrote Hamlet?",
]
MAX_TOKENS = 10
WINDOW = 8
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            **COMMON,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
    )


def _qwen3():
    """head_dim 32, not hidden / heads = 16: config.json's head_dim rules."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(
        Qwen3Config(
            **COMMON,
            head_dim=32,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        )
    )


def _llama_with_biases():
    """LLaMA with `attention_bias` (q/k/v and o biases): the engine used to drop them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            **COMMON,
            attention_bias=True,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        )
    )


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(
        MistralConfig(**COMMON, sliding_window=WINDOW, tie_word_embeddings=False)
    )


def _qwen2_sliding():
    """Qwen2's rule: layers from max_window_layers on slide (here layer 1 only)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            **COMMON,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
            tie_word_embeddings=True,
        )
    )


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(
        Gemma2Config(
            **{**COMMON, "num_attention_heads": 4},
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        )
    )


def _gemma3():
    """Local and global layers with their own RoPE: the global one linearly scaled (4B+)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    }
    return Gemma3ForCausalLM(
        Gemma3TextConfig(
            **COMMON,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=WINDOW,
            rope_parameters=rope,
            layer_types=["sliding_attention", "full_attention"],
        )
    )


def _phi3():
    """Fused qkv/gate_up checkpoint tensors, partial rotary and longrope factors."""
    from transformers import Phi3Config, Phi3ForCausalLM

    half = int(16 * 0.5) // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [2.0 + 0.5 * i for i in range(half)],
    }
    return Phi3ForCausalLM(
        Phi3Config(
            **COMMON,
            original_max_position_embeddings=64,
            rope_parameters=rope,
            tie_word_embeddings=False,
        )
    )


def _llama_yarn():
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 1e4,
    }
    return LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters=rope, tie_word_embeddings=True))


def _llama3_rope():
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 5e5,
    }
    return LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters=rope, tie_word_embeddings=True))


def _mixtral():
    """Experts on every layer and a sliding window on every layer (so blocks behind it are
    released)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            **COMMON,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            tie_word_embeddings=False,
        )
    )


def _qwen3_moe():
    """Sparse every second layer: layer 0 dense, layer 1 experts (renormalised top-k)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            **COMMON,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=2,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        )
    )


def _granite():
    from transformers import GraniteConfig, GraniteForCausalLM

    return GraniteForCausalLM(
        GraniteConfig(
            **COMMON,
            embedding_multiplier=6.0,
            attention_multiplier=0.2,
            residual_multiplier=0.5,
            logits_scaling=4.0,
            tie_word_embeddings=True,
        )
    )


def _olmo2():
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return Olmo2ForCausalLM(Olmo2Config(**COMMON, tie_word_embeddings=False))


ARCHS = {
    "qwen2": (_qwen2, "Qwen2ForCausalLM"),
    "qwen3": (_qwen3, "Qwen3ForCausalLM"),
    "llama-attention-bias": (_llama_with_biases, "Transformer"),
    "mistral": (_mistral, "MistralForCausalLM"),
    "qwen2-sliding": (_qwen2_sliding, "Qwen2ForCausalLM"),
    "gemma2": (_gemma2, "Gemma2ForCausalLM"),
    "gemma3": (_gemma3, "Gemma3ForCausalLM"),
    "phi3": (_phi3, "Phi3ForCausalLM"),
    "llama-yarn": (_llama_yarn, "Transformer"),
    "llama-llama3-rope": (_llama3_rope, "Transformer"),
    "mixtral": (_mixtral, "MixtralForCausalLM"),
    "qwen3-moe": (_qwen3_moe, "Qwen3MoeForCausalLM"),
    "granite": (_granite, "GraniteForCausalLM"),
    "olmo2": (_olmo2, "Olmo2ForCausalLM"),
}


def write_checkpoint(hf, model_dir, out):
    """Randomise biases and norm weights, save with the bundled tokenizer's files."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.copy_(p + 0.1 * torch.randn_like(p))
    hf.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(model_dir / name, out / name)
    return out


def one_sequence(args, n, backend):
    """A zeroed pool and a context for one sequence of n tokens (every KV group its own
    blocks)."""
    groups, num_blocks = args.kv_groups().num_groups, -(-n // 16)
    kv = allocate_kv_pool(num_blocks * groups, args, 16, torch.float32, torch.device("cpu"))
    meta = AttentionMetadata.single_sequence_groups(0, n, 16, num_blocks, groups)
    return ForwardContext.for_groups(backend, kv, meta)


@torch.inference_mode()
def our_logits(loaded, ids):
    n = len(ids)
    return loaded.model(
        torch.tensor(ids), torch.arange(n), one_sequence(loaded.args, n, TorchAttentionBackend())
    )


@torch.inference_mode()
def hf_greedy(hf, ids):
    """transformers' greedy continuation and the logprob of each chosen token."""
    out = hf.generate(
        torch.tensor([ids]),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(ids) :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)
    ]
    return tokens, logprobs


@pytest.mark.parametrize("arch", list(ARCHS))
def test_matches_transformers(arch, model_dir, tmp_path):
    build, class_name = ARCHS[arch]
    hf = build().eval()
    out = write_checkpoint(hf, model_dir, tmp_path / "model")
    ours = load_model(out)
    assert type(ours.model).__name__ == class_name
    assert ours.args.head_dim == (getattr(hf.config, "head_dim", None) or 64 // 4)
    prompts = [ours.tokenizer.encode(p) for p in PROMPTS]
    assert max(map(len, prompts)) > 2 * WINDOW
    refs = [hf_greedy(hf, ids) for ids in prompts]
    for ids in prompts:
        with torch.inference_mode():
            ref_logits = hf(torch.tensor([ids])).logits[0]
        diff = (our_logits(ours, ids) - ref_logits).abs().max().item()
        assert diff <= 1e-4, f"{arch}: max |logit diff| {diff}"

    # Four blocks for three sequences of three blocks each: someone is preempted (unless
    # every layer slides: then blocks behind the window go back to the pool).
    # A block holds one KV group's layers: four token blocks take four blocks per group.
    block = kv_block_bytes(ours.args, 16, torch.float32) * ours.args.kv_groups().num_groups
    llm = LLM(str(out), kv_cache_memory=4 * block, dtype="float32", max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    for attempt in ("cold", "cached"):
        results = llm.generate(prompts, params, use_tqdm=False)
        for res, (tokens, logprobs) in zip(results, refs):
            got = res.outputs[0]
            assert got.token_ids == tokens, f"{arch} ({attempt})"
            ours_lp = [lp.logprob for lp in got.logprobs]
            assert ours_lp == pytest.approx(logprobs, abs=1e-3), f"{arch} ({attempt})"
    stats = llm.engine.stats()
    if None in llm.engine.block_manager.group_windows:  # else the window makes room (below)
        assert stats.num_preemptions > 0, arch
    assert stats.prefix_cache_hits > 0, arch


def test_unsupported_config_is_refused_by_name(model_dir, tmp_path):
    from transformers import LlamaConfig

    out = tmp_path / "model"
    out.mkdir()
    LlamaConfig(
        **COMMON,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(model_dir / name, out / name)
    with pytest.raises(ValueError, match="unsupported rope type 'mrope'"):
        load_model(out)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3-moe", "phi3"])
def test_triton_path_matches_transformers(arch, model_dir, tmp_path):
    """The Triton attention backend with the fused kernels (interpreted on CPU): windows and
    two RoPE tables (Gemma 3), the fused MoE kernel (Qwen3-MoE), partial rotary (Phi-3) give
    transformers' prefill logits and greedy tokens too."""
    from engine.attention.triton_backend import TritonAttentionBackend

    build, _ = ARCHS[arch]
    hf = build().eval()
    out = write_checkpoint(hf, model_dir, tmp_path / "model")
    ours = load_model(out)
    ours.model.use_fused_kernels("triton")
    ids = ours.tokenizer.encode(PROMPTS[1])
    n = len(ids)
    with torch.inference_mode():
        logits = ours.model(
            torch.tensor(ids), torch.arange(n), one_sequence(ours.args, n, TritonAttentionBackend())
        )
        diff = (logits - hf(torch.tensor([ids])).logits[0]).abs().max().item()
    assert diff <= 1e-4, f"{arch}: max |logit diff| {diff}"

    llm = LLM(
        str(out),
        kv_cache_memory=8 << 20,
        dtype="float32",
        attention_backend="triton",
        max_num_batched_tokens=16,
    )
    assert llm.engine.loaded.model.kernels is not None
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[1:3]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with torch.inference_mode():
        refs = [
            hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids) :]
            for ids in prompts
        ]
    results = llm.generate(prompts, params, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in results] == [r.tolist() for r in refs]


def test_window_release_keeps_parity_in_a_pool_smaller_than_the_history(model_dir, tmp_path):
    """Mistral slides on every layer, so the engine releases the blocks behind the window:
    a 70-token prompt and 40 outputs (7 blocks of history) run in a 4-block pool and still
    give transformers' greedy tokens."""
    hf = _mistral().eval()
    out = write_checkpoint(hf, model_dir, tmp_path / "model")
    llm = LLM(
        str(out),
        kv_cache_memory=4 * kv_block_bytes(load_model(out).args, 16, torch.float32),
        dtype="float32",
        max_num_batched_tokens=16,
    )
    assert llm.engine.block_manager.group_windows == (WINDOW,)
    ids = llm.tokenizer.encode(" ".join([SHARED] * 5))[:70]
    assert len(ids) == 70
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0, len(ids) :]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    [res] = llm.generate([ids], params, use_tqdm=False)
    assert res.outputs[0].token_ids == ref.tolist()
    assert llm.engine.stats().num_preemptions == 0
