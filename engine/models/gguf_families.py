"""The model families a GGUF file can hold (llama.cpp's `general.architecture`), each mapped to
the HF checkpoint transformers would have: tensor names, llama.cpp's value transforms to undo,
and config.json.

Names follow gguf-py's `tensor_mapping.py`; config keys follow transformers' GGUF loader
(`integrations/ggml.py`) and, where the file is silent, the HF configs of the released models
and llama.cpp's own hard-coded values (e.g. Gemma 3's local RoPE base and window pattern).
Mistral 7B has no family of its own: llama.cpp writes it as `llama`, and HF's Mistral with no
sliding window computes exactly what HF's LLaMA does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.models.errors import ModelFileError


class Metadata:
    """A GGUF file's key/value metadata, read through its architecture's key prefix."""

    def __init__(self, fields: Mapping[str, Any], tensor_names: frozenset[str]) -> None:
        self._fields = fields
        self.tensor_names = tensor_names
        self.arch = str(self.get("general.architecture"))

    def get(self, key: str, default: Any = ModelFileError) -> Any:
        if key in self._fields:
            return self._fields[key]
        if default is ModelFileError:
            raise ModelFileError(f"GGUF metadata key {key!r} is missing")
        return default

    def of_arch(self, key: str, default: Any = ModelFileError) -> Any:
        """`{arch}.{key}`, e.g. `of_arch("block_count")` is `gemma3.block_count`."""
        return self.get(f"{self.arch}.{key}", default)


@dataclass(frozen=True)
class GgufFamily:
    hf_architecture: str
    model_type: str
    layer_tensors: Mapping[str, str]
    """GGUF `blk.N.<name>` -> HF `model.layers.N.<name>` (the `.weight`/`.bias` suffix kept)."""
    unpermute_qk: bool
    """llama.cpp interleaves the rotary halves of Q/K rows for the LLaMA family only."""
    norm_offset: float
    """llama.cpp stores Gemma's `(1 + w)` RMSNorm weights as `w + 1`; subtracted back here."""
    extra_config: Callable[[Metadata, int], dict[str, Any]]
    """Family-specific config.json keys, given the metadata and the number of layers."""


GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ATTENTION = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# LLaMA/Qwen: one norm before the MLP. Gemma 2/3 norm both sides of attention and of the MLP.
_PRE_MLP_NORM = {"ffn_norm": "post_attention_layernorm"}
_SANDWICH_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _no_sliding_window(meta: Metadata, num_layers: int) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": num_layers}


def _llama(meta: Metadata, num_layers: int) -> dict[str, Any]:
    return {
        "hidden_act": "silu",
        "mlp_bias": False,
        "attention_bias": "blk.0.attn_q.bias" in meta.tensor_names,
    }


def _qwen2(meta: Metadata, num_layers: int) -> dict[str, Any]:
    return {"hidden_act": "silu", **_no_sliding_window(meta, num_layers)}


def _qwen3(meta: Metadata, num_layers: int) -> dict[str, Any]:
    return {"hidden_act": "silu", "attention_bias": False, **_no_sliding_window(meta, num_layers)}


def _query_pre_attn_scalar(meta: Metadata, head_dim: int, num_layers_27b: int) -> float:
    """llama.cpp scales queries by 1/sqrt(head_dim), except for the 27B models, which use
    1/sqrt(hidden/heads) (as their HF configs' query_pre_attn_scalar)."""
    if meta.of_arch("block_count") == num_layers_27b:
        return meta.of_arch("embedding_length") // meta.of_arch("attention.head_count")
    return head_dim


def _layer_types(meta: Metadata, num_layers: int, default_pattern: int) -> list[str]:
    """Which layers attend within the sliding window: the file's per-layer flags, or every
    layer but each `pattern`-th (llama.cpp's `set_swa_pattern`, HF's sliding_window_pattern)."""
    pattern = meta.of_arch("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern][:num_layers]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _gemma2(meta: Metadata, num_layers: int) -> dict[str, Any]:
    head_dim = int(meta.of_arch("attention.key_length"))
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "attention_bias": False,
        "query_pre_attn_scalar": _query_pre_attn_scalar(meta, head_dim, num_layers_27b=46),
        "sliding_window": int(meta.of_arch("attention.sliding_window", 4096)),
        "layer_types": _layer_types(meta, num_layers, default_pattern=2),
        "attn_logit_softcapping": float(meta.of_arch("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(meta.of_arch("final_logit_softcapping", 30.0)),
    }


def _gemma3(meta: Metadata, num_layers: int) -> dict[str, Any]:
    head_dim = int(meta.of_arch("attention.key_length"))
    global_theta = float(meta.of_arch("rope.freq_base", 1_000_000.0))
    local_theta = float(meta.of_arch("rope.freq_base_swa", 10_000.0))  # llama.cpp's default
    full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": global_theta}
    rope_scaling = None
    if meta.of_arch("rope.scaling.type", "none") == "linear":  # the 4B/12B/27B models: 8x
        rope_scaling = {"rope_type": "linear", "factor": float(meta.of_arch("rope.scaling.factor"))}
        full_rope |= rope_scaling
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "attention_bias": False,
        "query_pre_attn_scalar": _query_pre_attn_scalar(meta, head_dim, num_layers_27b=62),
        "sliding_window": int(meta.of_arch("attention.sliding_window")),
        "sliding_window_pattern": 6,
        "layer_types": _layer_types(meta, num_layers, default_pattern=6),
        "rope_local_base_freq": local_theta,
        "rope_scaling": rope_scaling,
        # transformers >= 5 reads these instead of rope_theta/rope_local_base_freq/rope_scaling
        "rope_parameters": {
            "full_attention": full_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


FAMILIES: dict[str, GgufFamily] = {
    "llama": GgufFamily(
        "LlamaForCausalLM",
        "llama",
        {**_ATTENTION, **_PRE_MLP_NORM},
        unpermute_qk=True,
        norm_offset=0.0,
        extra_config=_llama,
    ),
    "qwen2": GgufFamily(
        "Qwen2ForCausalLM",
        "qwen2",
        {**_ATTENTION, **_PRE_MLP_NORM},
        unpermute_qk=False,
        norm_offset=0.0,
        extra_config=_qwen2,
    ),
    "qwen3": GgufFamily(
        "Qwen3ForCausalLM",
        "qwen3",
        {**_ATTENTION, **_QK_NORM, **_PRE_MLP_NORM},
        unpermute_qk=False,
        norm_offset=0.0,
        extra_config=_qwen3,
    ),
    "gemma2": GgufFamily(
        "Gemma2ForCausalLM",
        "gemma2",
        {**_ATTENTION, **_SANDWICH_NORMS},
        unpermute_qk=False,
        norm_offset=1.0,
        extra_config=_gemma2,
    ),
    "gemma3": GgufFamily(
        "Gemma3ForCausalLM",
        "gemma3_text",
        {**_ATTENTION, **_QK_NORM, **_SANDWICH_NORMS},
        unpermute_qk=False,
        norm_offset=1.0,
        extra_config=_gemma3,
    ),
}


def family_of(meta: Metadata) -> GgufFamily:
    family = FAMILIES.get(meta.arch)
    if family is None:
        raise ModelFileError(
            f"GGUF architecture {meta.arch!r} is not supported (supported: {', '.join(FAMILIES)})"
        )
    return family


def hf_tensor_name(family: GgufFamily, name: str) -> str | None:
    """The HF name of GGUF tensor `name`; None where the HF model has no such tensor
    (e.g. `rope_freqs`, which llama.cpp derives from the config)."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in family.layer_tensors:
        return f"model.layers.{parts[1]}.{family.layer_tensors[parts[2]]}.{parts[3]}"
    return GLOBAL_TENSORS.get(name)


def hf_config(
    meta: Metadata, vocab_size: int, tie_word_embeddings: bool, special: Mapping[str, int]
) -> dict[str, Any]:
    """config.json of the HF model the GGUF file describes."""
    family = family_of(meta)
    hidden = int(meta.of_arch("embedding_length"))
    num_heads = int(meta.of_arch("attention.head_count"))
    num_layers = int(meta.of_arch("block_count"))
    head_dim = (
        meta.of_arch("attention.key_length", None)
        or meta.of_arch("rope.dimension_count", None)
        or hidden // num_heads
    )
    return {
        "architectures": [family.hf_architecture],
        "model_type": family.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.of_arch("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.of_arch("attention.head_count_kv", num_heads)),
        "head_dim": int(head_dim),
        "max_position_embeddings": int(meta.of_arch("context_length")),
        "rms_norm_eps": float(meta.of_arch("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.of_arch("rope.freq_base", 10000.0)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
        **family.extra_config(meta, num_layers),
        **special,
        "torch_dtype": "float32",
    }
