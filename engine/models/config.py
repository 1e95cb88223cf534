"""Model hyper-parameters read from an HF `config.json`.

`ModelArgs` holds what every built-in decoder shares (sizes, RoPE, norms) plus the options
the architectures differ in (engine/models/layers.py reads them). `from_hf_config` reads the
fields all the HF layouts name alike; each model file (llama.py, qwen.py, mistral.py,
gemma.py, phi3.py, moe_models.py) passes the options its architecture implies. A config
field that changes the math and that these layers cannot run is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.kv.kv_groups import KVGroups
from engine.models.rope import RopeSpec
from engine.parallel.shard import TPShard

#: The built-in architectures and the `model_type`s their configs carry.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama",),
    "Qwen2ForCausalLM": ("qwen2",),
    "Qwen3ForCausalLM": ("qwen3",),
    "MistralForCausalLM": ("mistral",),
    "Gemma2ForCausalLM": ("gemma2",),
    "Gemma3ForCausalLM": ("gemma3_text",),
    "Phi3ForCausalLM": ("phi3",),
    "MixtralForCausalLM": ("mixtral",),
    "GraniteForCausalLM": ("granite",),
    "Olmo2ForCausalLM": ("olmo2",),
    "Qwen3MoeForCausalLM": ("qwen3_moe",),
}

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class MoEArgs:
    """A mixture-of-experts MLP (Mixtral, Qwen3-MoE) on the layers `sparse_layers` names."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    """Re-normalise the top-k routing weights to sum to 1 (Mixtral always; Qwen3-MoE with
    `norm_topk_prob`)."""
    round_routing_weights: bool
    """Round the routing weights to the model dtype (Qwen3-MoE) or keep them fp32 (Mixtral)."""
    sparse_layers: frozenset[int]


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    """The config's `head_dim` when given (Qwen3, Gemma: not dim // n_heads), else
    dim // n_heads."""
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2 always; LLaMA and Qwen3 with `attention_bias`)."""
    o_bias: bool = False
    """A bias on o_proj (LLaMA and Qwen3 with `attention_bias`; never Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on each q and k head, before RoPE (Qwen3, Gemma 3)."""
    layer_types: tuple[str, ...] = ()
    """Per layer, `sliding_attention` or `full_attention` (HF's `layer_types`); empty: all full."""
    sliding_window: int | None = None
    """The window of the sliding layers: a query at position p sees keys p - W + 1 .. p."""
    rope: RopeSpec | None = None
    """The layers' RoPE (engine/models/rope.py); None: plain RoPE of `rope_theta` over head_dim."""
    local_rope: RopeSpec | None = None
    """The sliding layers' RoPE when it differs (Gemma 3: its own base, no scaling)."""
    attn_scale: float | None = None
    """Softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)."""
    attn_softcap: float | None = None
    """Attention scores become c * tanh(s / c) (Gemma 2 `attn_logit_softcapping`)."""
    final_softcap: float | None = None
    """Logits become c * tanh(l / c) (Gemma 2/3 `final_logit_softcapping`)."""
    norm_unit_offset: bool = False
    """RMSNorm scales by (1 + w) in fp32 before the cast back (Gemma)."""
    norm_layout: str = "pre"
    """Where a block's norms sit: `pre` (LLaMA: before attention and MLP), `sandwich` (Gemma
    2/3: before and after each), `post` (OLMo 2: after each, on the branch output)."""
    qk_norm_whole: bool = False
    """With qk_norm: one RMSNorm over all of q's (and k's) heads together (OLMo 2), not per head."""
    embed_scale: float | None = None
    """Embeddings are multiplied by this (Gemma: sqrt(hidden_size), in the model's dtype;
    Granite: `embedding_multiplier`)."""
    residual_scale: float | None = None
    """Each block's attention and MLP outputs are multiplied by this before the residual add
    (Granite `residual_multiplier`)."""
    logits_divisor: float | None = None
    """Logits are divided by this (Granite `logits_scaling`)."""
    hidden_act: str = "silu"
    """The gated MLP's activation: `silu` (SwiGLU) or `gelu_pytorch_tanh` (GeGLU, Gemma)."""
    moe: MoEArgs | None = None
    tp: TPShard | None = None
    """This rank's place in a tensor-parallel group (engine/models/tp_slices.py `shard_args`):
    then n_heads, n_kv_heads, intermediate_size (and the experts' with tensor-parallel MoE)
    are the rank's; vocab_size stays the model's. None: one process holds the whole model."""

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, None for full attention."""
        if self.layer_types and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    def kv_groups(self) -> KVGroups:
        """How the layers share the KV pool's blocks (engine/kv/kv_groups.py)."""
        return KVGroups.from_windows([self.window(i) for i in range(self.n_layers)])

    def rope_spec(self, layer: int) -> RopeSpec:
        if self.local_rope is not None and self.window(layer) is not None:
            return self.local_rope
        if self.rope is not None:
            return self.rope
        return RopeSpec(
            head_dim=self.head_dim,
            rotary_dim=self.head_dim,
            theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
        )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], **options: Any) -> "ModelArgs":
        """The fields every built-in architecture shares; `options` come from the model class
        that knows its architecture. ValueError for what the built-in layers cannot run."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        model_type = cfg.get("model_type", "llama")
        if model_type not in HF_ARCHITECTURES.get(archs[0], ()):
            raise ValueError(
                f"unsupported architecture {archs} with model_type {model_type!r} "
                f"(built in: {', '.join(HF_ARCHITECTURES)})"
            )
        if cfg.get("mlp_bias"):
            raise ValueError(f"{archs[0]}: mlp_bias is not supported")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(
                f"{archs[0]}: use_bidirectional_attention (an encoder) is not supported"
            )
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(
                f"{archs[0]}: hidden activation {act!r} is not supported (silu, gelu_pytorch_tanh)"
            )
        n_heads, n_layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        rope = options.pop("rope", None) or RopeSpec.from_hf_config(cfg, head_dim=head_dim)
        fields: dict[str, Any] = dict(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.theta,
            rope=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            hidden_act=act,
        )
        fields.update(options)
        args = cls(**fields)
        if args.layer_types and len(args.layer_types) < n_layers:
            raise ValueError(
                f"{archs[0]}: layer_types names {len(args.layer_types)} layers, "
                f"the model has {n_layers}"
            )
        if args.layer_types and not set(args.layer_types) <= {SLIDING, FULL}:
            raise ValueError(
                f"{archs[0]}: layer_types {sorted(set(args.layer_types))} "
                f"(supported: {SLIDING}, {FULL})"
            )
        if SLIDING in args.layer_types and not args.sliding_window:
            raise ValueError(f"{archs[0]}: sliding layers without a sliding_window")
        return args


def hf_layer_types(
    cfg: dict[str, Any], n_layers: int, window: int | None, default_sliding: Any = None
) -> tuple[str, ...]:
    """The config's `layer_types`, else the architecture's rule (`default_sliding(i)` ->
    whether layer i slides), else every layer sliding when there is a window."""
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])[:n_layers]
    if not window:
        return ()
    if default_sliding is None:
        return (SLIDING,) * n_layers
    return tuple(SLIDING if default_sliding(i) else FULL for i in range(n_layers))
