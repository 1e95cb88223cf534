"""engine/models/rope.py against transformers' own rotary embedding classes: for every rope type the
table rows for positions within the original context equal transformers' cos/sin (which are
cat(freqs, freqs): duplicated halves; ours are cos_half | sin_half), attention scaling included;
beyond it, the rows equal what transformers' generate() computes for a token decoded there."""

import dataclasses
import math

import pytest
import torch

from engine.models.config import ModelArgs
from engine.models.layers import apply_rope, rope_rows
from engine.models.rope import SUPPORTED_ROPE_TYPES, RopeSpec, rope_cache

ATOL = 1e-6
SMALL = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)  # head_dim 16


def _hf_cos_sin(rotary, positions, **kwargs):
    """transformers' [N, rotary_dim] cos and sin for one sequence of `positions`."""
    cos, sin = rotary(torch.zeros(1), torch.tensor([positions]), **kwargs)
    return cos[0], sin[0]


def _assert_rows(table, positions, cos, sin):
    half = table.shape[1] // 2
    assert cos.shape[-1] == table.shape[1]
    torch.testing.assert_close(cos[:, :half], cos[:, half:], rtol=0, atol=0)
    rows = table[positions]
    torch.testing.assert_close(rows[:, :half], cos[:, :half], rtol=0, atol=ATOL)
    torch.testing.assert_close(rows[:, half:], sin[:, :half], rtol=0, atol=ATOL)


LLAMA_CASES = {
    "default": {"rope_type": "default", "rope_theta": 5e5},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 1e4},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 5e5,
    },
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 1e6,
    },
    "yarn_untruncated_attention_factor": {
        "rope_type": "yarn",
        "factor": 2.5,
        "original_max_position_embeddings": 128,
        "beta_fast": 16,
        "beta_slow": 2,
        "attention_factor": 1.3,
        "truncate": False,
        "rope_theta": 1e4,
    },
    "yarn_deepseek_mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 64,
        "rope_theta": 1e4,
    },
}


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama_rope_types_match_transformers(case):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        **SMALL, max_position_embeddings=256, rope_parameters=dict(LLAMA_CASES[case])
    )
    spec = RopeSpec.from_hf_config(config.to_dict())
    assert spec.rope_type == LLAMA_CASES[case]["rope_type"]
    table = rope_cache(spec)
    assert table.dtype == torch.float32
    assert table.shape == (spec.max_positions, 16) and spec.max_positions >= 256
    rotary = LlamaRotaryEmbedding(config)
    positions = list(range(256))  # static types: every position; dynamic: its whole context
    _assert_rows(table, positions, *_hf_cos_sin(rotary, positions))
    if spec.attention_scaling != 1.0:  # the scaling really is in the table
        assert table[0, 0].item() == pytest.approx(spec.attention_scaling)


def test_dynamic_beyond_the_context_matches_decoding_in_transformers():
    """A prompt that fits, decoded past max_position_embeddings: transformers rescales the base
    for each new length; each such token is one row of the table."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        **SMALL, max_position_embeddings=64, rope_parameters={"rope_type": "dynamic", "factor": 2.0}
    )
    spec = RopeSpec.from_hf_config(config.to_dict())
    table = rope_cache(spec)
    assert spec.max_positions == 128
    rotary = LlamaRotaryEmbedding(config)
    _assert_rows(table, list(range(40)), *_hf_cos_sin(rotary, list(range(40))))  # the prompt
    for p in (63, 64, 65, 90, 127):  # decode steps, one token each, increasing
        _assert_rows(table, [p], *_hf_cos_sin(rotary, [p]))


def _phi3(rope_parameters, **extra):
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = Phi3Config(**SMALL, rope_parameters=rope_parameters, **extra)
    return config, Phi3RotaryEmbedding(config)


def _longrope_params(rotary_dim):
    half = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 1e4,
        "short_factor": [1.0 + 0.05 * i for i in range(half)],
        "long_factor": [1.0 + 0.9 * i for i in range(half)],
    }


def test_longrope_with_partial_rotary_matches_transformers_within_and_beyond():
    config, rotary = _phi3(
        _longrope_params(8),
        partial_rotary_factor=0.5,
        max_position_embeddings=256,
        original_max_position_embeddings=64,
    )
    spec = RopeSpec.from_hf_config(config.to_dict())
    assert (spec.rotary_dim, spec.original_max_position_embeddings) == (8, 64)
    assert spec.attention_scaling == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
    table = rope_cache(spec)
    assert table.shape == (256, 8)
    _assert_rows(table, list(range(64)), *_hf_cos_sin(rotary, list(range(64))))
    for p in (64, 65, 200, 255):  # decoding past the original context: long factors
        _assert_rows(table, [p], *_hf_cos_sin(rotary, [p]))
    short_only = rope_cache(dataclasses.replace(spec, long_factor=spec.short_factor))
    assert torch.equal(table[:64], short_only[:64])
    assert not torch.allclose(table[64:], short_only[64:])


def test_su_is_longrope_and_old_layout_reads_like_rope_parameters():
    config, _ = _phi3(
        _longrope_params(16), max_position_embeddings=256, original_max_position_embeddings=64
    )
    new = RopeSpec.from_hf_config(config.to_dict())
    old = {
        **SMALL,
        "max_position_embeddings": 256,
        "original_max_position_embeddings": 64,
        "rope_theta": 1e4,
        "rope_scaling": {**_longrope_params(16), "type": "su"},
    }
    del old["rope_scaling"]["rope_type"], old["rope_scaling"]["rope_theta"]
    assert RopeSpec.from_hf_config(old) == new


def test_partial_rotary_layout_is_apply_rope_on_the_leading_slice():
    """Phi-3 rotates x[..., :rotary_dim] (halves within it) and passes the rest through."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    config, rotary = _phi3(
        {"rope_type": "default", "rope_theta": 1e4},
        partial_rotary_factor=0.5,
        max_position_embeddings=64,
    )
    spec = RopeSpec.from_hf_config(config.to_dict())
    table = rope_cache(spec)
    assert table.shape == (64, 8)
    positions = list(range(20))
    cos, sin = _hf_cos_sin(rotary, positions)
    _assert_rows(table, positions, cos, sin)
    q = torch.randn(1, 4, 20, 16)  # [B, H, T, D] as transformers
    expected, _ = apply_rotary_pos_emb(q, q, cos[None], sin[None])
    x = q[0].transpose(0, 1)  # [T, H, D] as the engine
    rd = spec.rotary_dim
    rows = rope_rows(table, torch.tensor(positions))
    ours = torch.cat((apply_rope(x[..., :rd], rows), x[..., rd:]), dim=-1)
    torch.testing.assert_close(ours, expected[0].transpose(0, 1), rtol=0, atol=1e-5)


def test_glm_partial_rotary_table():
    from transformers import GlmConfig
    from transformers.models.glm.modeling_glm import GlmRotaryEmbedding

    config = GlmConfig(**SMALL, head_dim=16, max_position_embeddings=128, pad_token_id=None)
    spec = RopeSpec.from_hf_config(config.to_dict())
    assert (spec.head_dim, spec.rotary_dim) == (16, 8)
    positions = list(range(128))
    _assert_rows(rope_cache(spec), positions, *_hf_cos_sin(GlmRotaryEmbedding(config), positions))


def test_gemma3_per_layer_type_parameters():
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = Gemma3TextConfig(
        **SMALL,
        head_dim=16,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"],
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    cfg = config.to_dict()
    with pytest.raises(ValueError, match="params="):
        RopeSpec.from_hf_config(cfg)
    rotary = Gemma3RotaryEmbedding(config)
    positions = list(range(100))
    for layer_type, (rope_type, theta) in {
        "full_attention": ("linear", 1e6),
        "sliding_attention": ("default", 1e4),
    }.items():
        spec = RopeSpec.from_hf_config(cfg, params=cfg["rope_parameters"][layer_type])
        assert (spec.rope_type, spec.theta) == (rope_type, theta)
        _assert_rows(
            rope_cache(spec), positions, *_hf_cos_sin(rotary, positions, layer_type=layer_type)
        )


def test_old_layout_equals_rope_parameters_layout():
    params = dict(LLAMA_CASES["llama3"])
    theta = params.pop("rope_theta")
    old = {**SMALL, "max_position_embeddings": 256, "rope_theta": theta, "rope_scaling": params}
    new = {
        **SMALL,
        "max_position_embeddings": 256,
        "rope_parameters": {**params, "rope_theta": theta},
    }
    assert RopeSpec.from_hf_config(old) == RopeSpec.from_hf_config(new)
    assert RopeSpec.from_hf_config(old).theta == 5e5
    overridden = RopeSpec.from_hf_config(old, theta=1e4, head_dim=32)
    assert (overridden.theta, overridden.rotary_dim) == (1e4, 32)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"type": "mrope", "mrope_section": [2, 3, 3]},
        {"rope_type": "default", "mrope_section": [2, 3, 3]},
        {"rope_type": "proportional", "partial_rotary_factor": 0.25},
        {"rope_type": "ntk-by-parts", "factor": 2.0},
    ],
)
def test_unknown_rope_type_is_an_error_naming_it(rope_scaling):
    cfg = {**SMALL, "max_position_embeddings": 256, "rope_scaling": rope_scaling}
    name = rope_scaling.get("type") or rope_scaling["rope_type"]
    name = "mrope" if name == "default" else name
    with pytest.raises(ValueError, match=f"'{name}'.*supported: {', '.join(SUPPORTED_ROPE_TYPES)}"):
        RopeSpec.from_hf_config(cfg)


def test_missing_parameters_and_wrong_factor_lengths_are_errors():
    with pytest.raises(ValueError, match="low_freq_factor"):
        RopeSpec.from_hf_config({**SMALL, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="short_factor has 3 entries"):
        RopeSpec.from_hf_config(
            {
                **SMALL,
                "rope_scaling": {
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 3,
                    "long_factor": [1.0] * 8,
                },
            }
        )


def test_default_equals_todays_table():
    cfg = {**SMALL, "max_position_embeddings": 512, "rope_theta": 5e5, "rms_norm_eps": 1e-6}
    spec = RopeSpec.from_hf_config(cfg)
    assert spec.max_positions == 512
    half = spec.head_dim // 2  # the table the engine built before rope.py, inline
    inv_freq = 1.0 / (5e5 ** (torch.arange(0, half, dtype=torch.int64).float() / half))
    freqs = torch.outer(torch.arange(512, dtype=torch.float32), inv_freq)
    assert torch.equal(rope_cache(spec), torch.cat((freqs.cos(), freqs.sin()), dim=-1))
    assert ModelArgs.from_hf_config(cfg).rope_spec(0) == spec
