"""RoPE tables for every scaling variant transformers ships for decoder LMs: `default`, `linear`,
`dynamic` (NTK), `llama3`, `yarn` and `longrope` (transformers' `ROPE_INIT_FUNCTIONS`, 5.x).

`RopeSpec` is everything that determines the table; `RopeSpec.from_hf_config` reads it from a
config.json (the old `rope_theta` + `rope_scaling` layout and transformers>=5's `rope_parameters`);
`rope_cache(spec)` builds it.

Table layout (what `layers.apply_rope` and the Triton rope kernel index): fp32
`[spec.max_positions, spec.rotary_dim]`, row p = `cos(p * f) * s | sin(p * f) * s` over the
rotary_dim // 2 frequencies f, where s is the variant's attention scaling (yarn's mscale, longrope's
attention_factor; 1 elsewhere), multiplied into cos and sin exactly as transformers does. For
`default` with rotary_dim == head_dim this is bit-for-bit today's `layers.rope_cache`.

Partial rotary (`partial_rotary_factor` < 1: Phi-3/Phi-4-mini, GLM, StableLM, ...): rotary_dim =
int(head_dim * partial_rotary_factor) and the table is `[max_positions, rotary_dim]`, not head_dim
wide. transformers rotates only `x[..., :rotary_dim]` and passes `x[..., rotary_dim:]` through
unchanged. Within the rotated slice Phi-3 (like LLaMA) pairs dim i with i + rotary_dim // 2, so
`apply_rope(x[..., :rotary_dim], rope_rows(table, positions))` followed by a concat of the
pass-through part is exact;
GLM pairs adjacent dims (2i, 2i + 1) with the same frequencies: same table, interleaved apply.
The pairing belongs to the architecture, not to the table, so it is not in RopeSpec.

Position-dependent variants. transformers recomputes the frequencies per forward call from the
sequence length; a paged engine caches K already rotated, so here each variant is one fixed table
indexed by absolute position:

* `dynamic`: rows p < max_position_embeddings (transformers' reference length for dynamic NTK; it
  ignores original_max_position_embeddings) are plain RoPE, exactly as transformers for any
  sequence that fits. Row p beyond uses the NTK base transformers computes for seq_len = p + 1.
  That is what transformers' own generate() with a KV cache does when a prompt that fits is
  decoded past the limit (each step rescales for the new length and cached keys keep their old
  rotation), so the table matches it token for token. It differs when one forward already
  exceeds the limit (a long prefill): transformers then rotates every position with
  base(seq_len). vLLM instead uses base(max_position_embeddings * factor) for all positions,
  which changes even short prompts; we do not. The table holds max_position_embeddings * factor
  rows.
* `longrope`: rows p < original_max_position_embeddings use short_factor, rows beyond use
  long_factor (only exist when max_position_embeddings > original). Exact for sequences within the
  original context, and for prompts within it decoded past it (transformers' generate() switches to
  the long factors for new tokens only, as here). It differs for a prompt that itself exceeds the
  original context: transformers (and vLLM, per batch) then use long factors for all positions,
  including those below the original length. The attention factor is the same for both sets.

Table length (`max_positions`): never fewer than the config's max_position_embeddings; `dynamic`
extends to max_position_embeddings * factor and `yarn` to original_max_position_embeddings * factor
(Qwen's documented YaRN setup keeps max_position_embeddings at the pretraining length), as vLLM.

Not here: `proportional` (Gemma 4), `mrope` (Qwen2-VL 3-D positions, also a `default` dict with
`mrope_section`) and any other type raise ValueError (`su`, early Phi-3's name, reads as
`longrope`, as transformers' Phi3Config does). Per-layer-type configs (Gemma 3) pass one sub-dict
through `params=`. DeepSeek's extra softmax scale mscale(factor, mscale_all_dim)**2 belongs to its
attention, not to this table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

_T = TypeVar("_T")


def _checked(value: _T | None) -> _T:
    """A scaling field that `RopeSpec.__post_init__` requires of the spec's rope type."""
    assert value is not None
    return value


SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    """Everything that determines a RoPE table; the scaling fields a type does not use stay None
    (as `from_hf_config` leaves them) or are ignored."""

    head_dim: int
    rotary_dim: int
    """int(head_dim * partial_rotary_factor): only x[..., :rotary_dim] rotates; the table width."""
    theta: float
    max_position_embeddings: int
    """The config's value (for `dynamic`, transformers' reference length)."""
    rope_type: str = "default"
    factor: float | None = None
    """linear/dynamic/llama3/yarn scaling factor; longrope: only sets the default attention
    factor. None for yarn/longrope means max_position_embeddings / original."""
    original_max_position_embeddings: int | None = None
    """Pretraining context (llama3, yarn, longrope)."""
    low_freq_factor: float | None = None
    """llama3."""
    high_freq_factor: float | None = None
    """llama3."""
    beta_fast: float | None = None
    """yarn; None (or 0) means 32."""
    beta_slow: float | None = None
    """yarn; None (or 0) means 1."""
    mscale: float | None = None
    """yarn (DeepSeek): with mscale_all_dim, sets the default attention factor."""
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    """yarn/longrope: explicit cos/sin scale; None means the variant's formula."""
    short_factor: tuple[float, ...] | None = None
    """longrope: rotary_dim // 2 per-frequency divisors within the original context."""
    long_factor: tuple[float, ...] | None = None
    """longrope: the divisors beyond it."""
    truncate: bool = True
    """yarn: floor/ceil the correction range (transformers' default True)."""

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r} "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(
                f"rotary_dim {self.rotary_dim} must be even and within head_dim {self.head_dim}"
            )
        needed = {
            "linear": ("factor",),
            "dynamic": ("factor",),
            "llama3": (
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            ),
            "yarn": ("original_max_position_embeddings",),
            "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
        }.get(self.rope_type, ())
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"rope type {self.rope_type!r} needs {', '.join(missing)}")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None and len(value) != self.rotary_dim // 2:
                raise ValueError(
                    f"longrope {name} has {len(value)} entries, rotary_dim "
                    f"{self.rotary_dim} needs {self.rotary_dim // 2}"
                )

    @property
    def scale(self) -> float:
        """The factor, with transformers' default for yarn/longrope when the config has none."""
        if self.factor is not None:
            return float(self.factor)
        if self.rope_type in ("yarn", "longrope"):
            return self.max_position_embeddings / _checked(self.original_max_position_embeddings)
        return 1.0

    @property
    def attention_scaling(self) -> float:
        """What transformers multiplies into cos and sin (1 for all but yarn and longrope)."""
        if self.rope_type not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        factor = self.scale
        if self.rope_type == "yarn":
            if self.mscale and self.mscale_all_dim:
                return float(
                    _yarn_mscale(factor, self.mscale) / _yarn_mscale(factor, self.mscale_all_dim)
                )
            return _yarn_mscale(factor)
        if self.rope_type == "longrope" and factor > 1.0:
            context = _checked(self.original_max_position_embeddings)
            return math.sqrt(1 + math.log(factor) / math.log(context))
        return 1.0

    @property
    def max_positions(self) -> int:
        """Rows of the table: the positions the engine can run (see the module docstring)."""
        if self.rope_type == "dynamic":
            return max(self.max_position_embeddings, int(self.max_position_embeddings * self.scale))
        if self.rope_type == "yarn":
            return max(
                self.max_position_embeddings,
                int(_checked(self.original_max_position_embeddings) * self.scale),
            )
        return self.max_position_embeddings

    @classmethod
    def from_hf_config(
        cls,
        cfg: dict[str, Any],
        *,
        theta: float | None = None,
        head_dim: int | None = None,
        params: dict[str, Any] | None = None,
    ) -> "RopeSpec":
        """Reads `rope_scaling` (old layout; `type` or `rope_type`) or `rope_parameters`
        (transformers>=5; holds rope_theta too), and `rope_theta`, `partial_rotary_factor`,
        `head_dim`, `max_position_embeddings` and a top-level `original_max_position_embeddings`
        (Phi-3; it takes precedence, as in transformers). `params` replaces the config's rope
        dict, e.g. `cfg["rope_parameters"]["sliding_attention"]` for Gemma 3 in transformers>=5
        (per-layer-type dicts without `params` are a ValueError); `theta` and `head_dim` override
        the config's (Gemma 3's old layout: sliding layers are `params={}`,
        `theta=cfg["rope_local_base_freq"]`). ValueError for a rope type this engine cannot run,
        naming it."""
        whole_config = params is None
        if params is None:
            params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
            if any(isinstance(v, dict) for v in params.values()):
                raise ValueError(
                    f"per-layer-type rope parameters ({', '.join(params)}): pass one "
                    "of them as params="
                )
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type == "su":
            rope_type = "longrope"  # early Phi-3 configs; transformers' Phi3Config renames it too
        if rope_type == "default" and params.get("mrope_section") is not None:
            rope_type = "mrope"  # multimodal 3-D positions: a different model, not plain RoPE
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {rope_type!r} "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if theta is None:
            theta = params.get("rope_theta") or cfg.get("rope_theta") or 10000.0
        if head_dim is None:
            head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        partial = params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
        max_pos = cfg.get("max_position_embeddings", 2048)
        original = None
        if rope_type in ("llama3", "yarn", "longrope"):  # transformers' order of precedence
            original = params.get("original_max_position_embeddings") or max_pos
            if whole_config and cfg.get("original_max_position_embeddings"):
                original = cfg["original_max_position_embeddings"]
        truncate = params.get("truncate")

        def tuple_or_none(key: str) -> tuple[float, ...] | None:
            value = params.get(key)
            return None if value is None else tuple(float(x) for x in value)

        return cls(
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            theta=float(theta),
            max_position_embeddings=max_pos,
            rope_type=rope_type,
            factor=params.get("factor"),
            original_max_position_embeddings=original,
            low_freq_factor=params.get("low_freq_factor"),
            high_freq_factor=params.get("high_freq_factor"),
            beta_fast=params.get("beta_fast"),
            beta_slow=params.get("beta_slow"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            short_factor=tuple_or_none("short_factor"),
            long_factor=tuple_or_none("long_factor"),
            truncate=True if truncate is None else bool(truncate),
        )


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# The inverse-frequency formulas below keep transformers' order of fp32 operations: one ulp of
# inv_freq is p ulps of angle at position p, so an algebraically equal rewrite would not match.


def _exponents(spec: RopeSpec, device: torch.device | None) -> Tensor:
    """2i / rotary_dim for i < rotary_dim // 2, fp32."""
    dim = spec.rotary_dim
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def _plain(spec: RopeSpec, device: torch.device | None) -> Tensor:
    return 1.0 / (spec.theta ** _exponents(spec, device))


def _llama3(spec: RopeSpec, device: torch.device | None) -> Tensor:
    inv_freq, factor = _plain(spec, device), _checked(spec.factor)
    low, high = _checked(spec.low_freq_factor), _checked(spec.high_freq_factor)
    context = _checked(spec.original_max_position_embeddings)
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are divided by factor, short ones kept, and the band
    # between context / high_freq_factor and context / low_freq_factor blends the two.
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(in_band, blended, scaled)


def _yarn(spec: RopeSpec, device: torch.device | None) -> Tensor:
    dim, base, factor = spec.rotary_dim, spec.theta, spec.scale
    context = _checked(spec.original_max_position_embeddings)

    def correction_dim(rotations: float) -> float:
        """The dimension whose wavelength fits `rotations` times into the original context."""
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast or 32), correction_dim(spec.beta_slow or 1)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp.to(device=device, dtype=torch.float)  # 1: extrapolate (original frequency)
    powers = base ** _exponents(spec, device)
    return (1.0 / (factor * powers)) * (1 - keep) + (1.0 / powers) * keep


def _longrope(spec: RopeSpec, factors: tuple[float, ...], device: torch.device | None) -> Tensor:
    ext = torch.tensor(factors, dtype=torch.float32, device=device)
    return 1.0 / (ext * spec.theta ** _exponents(spec, device))


def _dynamic_base(spec: RopeSpec, seq_len):
    """The NTK-rescaled base for a sequence of seq_len (an int, or an int64 tensor as transformers
    computes it at run time)."""
    f, dim, ref = _checked(spec.factor), spec.rotary_dim, spec.max_position_embeddings
    return spec.theta * ((f * seq_len / ref) - (f - 1)) ** (dim / (dim - 2))


def _angles(positions: Tensor, inv_freq: Tensor) -> Tensor:
    """[P] x ([half] or [P, half]) -> [P, half]: transformers' product, element for element."""
    return positions[:, None] * inv_freq


def rope_cache(
    spec: RopeSpec, device: torch.device | None = None, min_positions: int = 0
) -> Tensor:
    """fp32 `[max(spec.max_positions, min_positions), spec.rotary_dim]`: cos(p * f) * s |
    sin(p * f) * s (see the module docstring for the layout and for `dynamic`/`longrope`
    beyond the original context). `min_positions` past the spec's: the same formulas run on
    (a context length served beyond training, VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
    n = max(spec.max_positions, min_positions)
    t = torch.arange(n, device=device, dtype=torch.float32)
    if spec.rope_type == "default":
        freqs = _angles(t, _plain(spec, device))
    elif spec.rope_type == "linear":
        freqs = _angles(t, _plain(spec, device) / _checked(spec.factor))
    elif spec.rope_type == "llama3":
        freqs = _angles(t, _llama3(spec, device))
    elif spec.rope_type == "yarn":
        freqs = _angles(t, _yarn(spec, device))
    elif spec.rope_type == "dynamic":
        ref = spec.max_position_embeddings
        inside = 1.0 / (_dynamic_base(spec, ref) ** _exponents(spec, device))
        seq_lens = torch.arange(ref + 1, n + 1, dtype=torch.int64, device=device)
        beyond = 1.0 / (_dynamic_base(spec, seq_lens)[:, None] ** _exponents(spec, device))
        freqs = torch.cat((_angles(t[:ref], inside), _angles(t[ref:], beyond)))
    else:  # longrope
        split = min(_checked(spec.original_max_position_embeddings), n)
        short, long = _checked(spec.short_factor), _checked(spec.long_factor)
        freqs = torch.cat(
            (
                _angles(t[:split], _longrope(spec, short, device)),
                _angles(t[split:], _longrope(spec, long, device)),
            )
        )
    s = spec.attention_scaling
    return torch.cat((freqs.cos() * s, freqs.sin() * s), dim=-1)
