"""The building blocks of HF-layout decoder models, gpt-fast style: RMSNorm, RoPE, GQA
attention through the engine's paged attention backend, the gated MLP and the decoder block.
Per-architecture options come from ModelArgs (engine/models/config.py): projection biases,
per-head q/k norms, an explicit head_dim, per-layer sliding windows and RoPE bases, the
softmax scale and score soft-capping, Gemma's (1 + w) norms, where a block's norms sit (pre,
Gemma's "sandwich", OLMo 2's post), Granite's residual multiplier, the MLP's activation, and
where a layer's K/V live (its KV group's blocks, engine/kv/kv_groups.py). With `ctx.layer_ops` set
RMSNorm (with the residual add before it), RoPE and SiLU-and-mul run as fused kernels: Triton's
with the Triton attention backend, the C++ ones on the CPU (engine/cpu_kernels).

Each module maps the checkpoint's names below it onto its (fused) parameters with
`weight_target(name)`: the tensor, or the row range of a fused one, that an HF tensor fills —
the model's `load_weights` and `update_weights` both go through it.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models.config import ModelArgs
from engine.models.interface import ForwardContext
from engine.parallel.shard import all_reduce

PACKED_MAX_ROWS = 256
"""bf16 projections on the CPU with at most this many input rows (decode batches, small
prefill chunks) run from a weight prepacked once into oneDNN's blocked layout
(`pack_linears`): F.linear reorders the weight on every call. One layer's four projections of
the default model, random weights cycled out of cache, AMX-BF16 Xeon: packed / F.linear
0.71-0.77 at 32 rows, 0.72-0.81 at 64, 0.81-0.89 at 128, 0.84-0.94 at 256, 1.03-1.09 at 512
(1 and 2 threads), so larger inputs (prefill) keep F.linear. Up to 32 rows the result is
bit-identical to F.linear; above, oneDNN blocks the sums differently and about one output in
10,000 rounds to the neighbouring bf16 value (the same error against the fp32 product)."""


class PackedWeight:
    """A weight's oneDNN-packed copy, rebuilt whenever the weight changes (moved, replaced,
    or updated in place: its storage pointer or version counter moved)."""

    __slots__ = ("key", "packed")

    def __init__(self) -> None:
        self.key: tuple[int, int, torch.dtype, torch.Size] | None = None
        self.packed: Tensor | None = None

    def get(self, weight: Tensor) -> Tensor | None:
        """The packed copy of `weight`; None for an inference tensor (no version counter to
        notice an in-place update by)."""
        if weight.is_inference():
            return None
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.shape)
        if key != self.key:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
            self.key = key
        return self.packed


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, packed: PackedWeight | None) -> Tensor:
    """F.linear, from the packed weight where `pack_linears` set one and `x` fits."""
    if (
        packed is not None
        and x.dim() == 2
        and x.shape[0] <= PACKED_MAX_ROWS
        and x.dtype == weight.dtype
    ):
        w = packed.get(weight)
        if w is not None:
            return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return F.linear(x, weight, bias)


def bf16_packing_supported() -> bool:
    """Whether bf16 weights are packed on this CPU: where oneDNN multiplies bf16 natively
    (AVX512-BF16 or AMX), bit-identically to F.linear at decode rows. On an AVX2-only CPU
    `_reorder_linear_weight` raises; on AVX-512 without BF16 (emulated) the packed LM head's
    decode row came out one bf16 rounding away from F.linear's (Intel Xeon, 576 x 49,152),
    which changed greedy tokens: bf16 projections stay on F.linear there."""
    from engine.runner.device import cpu_has_native_bf16

    return (
        torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        and cpu_has_native_bf16()
    )


def pack_linears(model: nn.Module, enabled: bool = True) -> bool:
    """Turn packed weights on (or off) for the model's Linear layers and its LM head (where it
    has a `lm_head_packed` slot); on only for a bf16 model on a CPU whose oneDNN supports bf16
    (`bf16_packing_supported`), and unless PDSERVE_PACKED_LINEARS=0. Returns whether they are
    on. The packed copies double the projections' memory."""
    weight = next(model.parameters(), None)
    enabled = (
        enabled
        and os.environ.get("PDSERVE_PACKED_LINEARS", "1") != "0"
        and weight is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and bf16_packing_supported()
    )
    for module in model.modules():
        if isinstance(module, Linear):
            module.packed = PackedWeight() if enabled else None
    if hasattr(model, "lm_head_packed"):
        setattr(model, "lm_head_packed", PackedWeight() if enabled else None)
    return enabled


class Linear(nn.Linear):
    """nn.Linear without random init: weights always come from a checkpoint."""

    packed: PackedWeight | None = None

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """LLaMA's RMSNorm (w * normed, cast first); with `unit_offset` Gemma's ((1 + w) *
    normed in fp32, cast last)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        if self.unit_offset:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        if ctx.layer_ops is not None:
            return ctx.layer_ops.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(
        self, x: Tensor, residual: Tensor, ctx: ForwardContext
    ) -> tuple[Tensor, Tensor]:
        """(self(x + residual), x + residual): one fused pass where `ctx.layer_ops` has one."""
        if ctx.layer_ops is not None and not self.unit_offset:
            return ctx.layer_ops.add_rms_norm(x, residual, self.weight, self.eps)
        summed = x + residual
        return self(summed, ctx), summed


def rope_rows(table: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """A RoPE table's (cos | sin, engine/models/rope.py) rows at `positions` as the two
    factors `apply_rope` multiplies by: [T, 1, R] each, (cos | cos) and (-sin | sin). Built
    once per forward, shared by every layer."""
    cos, sin = table[positions, None].chunk(2, dim=-1)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: Tensor, rows: tuple[Tensor, Tensor]) -> Tensor:
    """x: [T, H, D]; rows: `rope_rows` ([T, 1, R], R <= D): the first R dims rotate, in
    non-interleaved halves (HF convention); the rest pass through. In fp32: x * (cos | cos) +
    (x2 | x1) * (-sin | sin) gives, element by element, the same products and sums as HF's
    x1 * cos - x2 * sin | x2 * cos + x1 * sin (a - b == a + -b exactly)."""
    cos2, sin2 = rows
    rot = cos2.shape[-1]
    half = rot // 2
    xr = x[..., :rot].float()
    swapped = torch.cat((xr[..., half:], xr[..., :half]), dim=-1)
    rotated = (xr * cos2 + swapped * sin2).to(x.dtype)
    return rotated if rot == x.shape[-1] else torch.cat((rotated, x[..., rot:]), dim=-1)


def _whole_rms_norm(x: Tensor, norm: "RMSNorm", dims: int, ctx: ForwardContext) -> Tensor:
    """RMSNorm over a vector split across the tensor-parallel ranks (OLMo 2's q/k norm over
    all heads): this rank's values [T, local] normed by the all-reduced sum of squares over
    `dims` values; `norm.weight` holds this rank's part."""
    x32 = x.float()
    sq = x32.pow(2).sum(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(all_reduce(sq, ctx.comm) / dims + norm.eps)
    return norm.weight * x32.to(x.dtype)


def _rows(tensor: Tensor | None, start: int, length: int | None, name: str) -> Tensor:
    if tensor is None:  # e.g. a bias this architecture does not have
        raise KeyError(name)
    return tensor if length is None else tensor[start : start + length]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, rope_index: int = 0) -> None:
        super().__init__()
        self.layer, self.rope_index = layer, rope_index
        # Where this layer's K/V live: its KV group's blocks, at its slot in them.
        self.kv_group, self.kv_slot = args.kv_groups().place(layer)
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_size = args.n_heads * args.head_dim
        self.kv_size = args.n_kv_heads * args.head_dim
        self.qkv_proj = Linear(args.dim, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = Linear(self.q_size, args.dim, bias=args.o_bias)
        self.scale = args.attn_scale if args.attn_scale is not None else args.head_dim**-0.5
        # Only the options a layer has reach the backend (none for plain LLaMA).
        self.options: dict[str, Any] = {
            k: v
            for k, v in (
                ("sliding_window", args.window(layer)),
                ("logits_soft_cap", args.attn_softcap),
            )
            if v is not None
        }
        # Qwen3, Gemma 3: RMSNorm over each head's head_dim, before RoPE; OLMo 2: over all
        # of q's (k's) heads at once.
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        self.qk_norm_whole = args.qk_norm_whole
        if args.qk_norm:
            q_dim, k_dim = (
                (self.q_size, self.kv_size) if args.qk_norm_whole else (args.head_dim,) * 2
            )
            self.q_norm = RMSNorm(q_dim, args.norm_eps, args.norm_unit_offset)
            self.k_norm = RMSNorm(k_dim, args.norm_eps, args.norm_unit_offset)
        # Tensor parallel: an RMSNorm over all heads sums squares across the ranks.
        self.whole_dims: tuple[int, int] | None = None
        if args.qk_norm_whole and args.tp is not None:
            self.whole_dims = (args.tp.whole_norm_dims(kv=False), args.tp.whole_norm_dims(kv=True))

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if ctx.lora is not None:
            ctx.lora.add(
                qkv,
                x,
                self.layer,
                (("q_proj", 0), ("k_proj", self.q_size), ("v_proj", self.q_size + self.kv_size)),
            )
        if self.q_norm is None and ctx.layer_ops is None:
            assert ctx.cos_sin is not None  # the model fills it where there are no layer_ops
            # q and k side by side in qkv: one RoPE over their heads (same values as two).
            qk = apply_rope(
                qkv[:, : self.q_size + self.kv_size].view(T, -1, self.head_dim),
                ctx.cos_sin[self.rope_index],
            )
            q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
            v = qkv[:, self.q_size + self.kv_size :].view(T, self.n_kv_heads, self.head_dim)
            return self._attend(q, k, v, ctx)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_norm, k_norm = self.q_norm, self.k_norm  # both set with args.qk_norm, or neither
        if self.qk_norm_whole:
            assert q_norm is not None and k_norm is not None  # qk_norm_whole is a qk_norm
            if self.whole_dims is not None:
                q = _whole_rms_norm(q, q_norm, self.whole_dims[0], ctx)
                k = _whole_rms_norm(k, k_norm, self.whole_dims[1], ctx)
            else:
                q, k = q_norm(q, ctx), k_norm(k, ctx)
        q = q.view(T, self.n_heads, self.head_dim)
        k = k.view(T, self.n_kv_heads, self.head_dim)
        v = v.view(T, self.n_kv_heads, self.head_dim)
        if q_norm is not None and k_norm is not None and not self.qk_norm_whole:
            q, k = q_norm(q, ctx), k_norm(k, ctx)
        if ctx.layer_ops is not None:
            assert ctx.positions is not None and ctx.rope_cos_sin is not None  # the model's
            ctx.layer_ops.apply_rope(
                q, k, ctx.positions, ctx.rope_cos_sin[self.rope_index]
            )  # in place
        else:
            assert ctx.cos_sin is not None  # the model fills it where there are no layer_ops
            rows = ctx.cos_sin[self.rope_index]
            q, k = apply_rope(q, rows), apply_rope(k, rows)
        return self._attend(q, k, v, ctx)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: ForwardContext) -> Tensor:
        """Attention over the pool, then o_proj (+ its LoRA)."""
        T = q.shape[0]
        o = ctx.backend.forward(
            q,
            k,
            v,
            ctx.kv_cache,
            self.kv_slot,
            ctx.layer_metadata(self.kv_group),
            self.scale,
            **self.options,
        )
        o = o.reshape(T, self.q_size)
        out = self.o_proj(o)
        if ctx.lora is not None:
            ctx.lora.add(out, o, self.layer, (("o_proj", 0),))
        return all_reduce(out, ctx.comm)  # row-parallel: the ranks' heads summed

    def weight_target(self, name: str) -> Tensor:
        """`q_proj.weight`, `qkv_proj.bias` (Phi-3's fused name), `q_norm.weight`, ..."""
        proj, _, kind = name.partition(".")
        if proj in ("q_norm", "k_norm") and kind == "weight" and self.q_norm is not None:
            return getattr(self, proj).weight
        q, kv = self.q_size, self.kv_size
        rows = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "qkv_proj": ("qkv_proj", 0, None),
            "o_proj": ("o_proj", 0, None),
        }
        if proj not in rows or kind not in ("weight", "bias"):
            raise KeyError(name)
        param, start, length = rows[proj]
        return _rows(getattr(getattr(self, param), kind), start, length, name)


class FeedForward(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.inter = args.intermediate_size
        self.gelu = args.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.down_proj = Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if ctx.lora is not None:
            ctx.lora.add(gate_up, x, self.layer, (("gate_proj", 0), ("up_proj", self.inter)))
        if self.gelu:
            gate, up = gate_up.split([self.inter, self.inter], dim=-1)
            h = F.gelu(gate, approximate="tanh") * up
        elif ctx.layer_ops is not None:
            h = ctx.layer_ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split([self.inter, self.inter], dim=-1)
            h = F.silu(gate) * up
        out = self.down_proj(h)
        if ctx.lora is not None:
            ctx.lora.add(out, h, self.layer, (("down_proj", 0),))
        return all_reduce(out, ctx.comm)  # row-parallel: the ranks' rows summed

    def weight_target(self, name: str) -> Tensor:
        """`gate_proj.weight`, `up_proj.weight`, `down_proj.weight`, or Phi-3's fused
        `gate_up_proj.weight`."""
        rows = {
            "gate_proj.weight": ("gate_up_proj", 0, self.inter),
            "up_proj.weight": ("gate_up_proj", self.inter, self.inter),
            "gate_up_proj.weight": ("gate_up_proj", 0, None),
            "down_proj.weight": ("down_proj", 0, None),
        }
        if name not in rows:
            raise KeyError(name)
        param, start, length = rows[name]
        return _rows(getattr(self, param).weight, start, length, name)


class BlockMLP(Protocol):
    """A block's MLP as the block uses it: `FeedForward`, or a mixture of experts (moe.py)."""

    def __call__(self, x: Tensor, ctx: ForwardContext) -> Tensor: ...

    def weight_target(self, name: str, /) -> Tensor: ...


class TransformerBlock(nn.Module):
    """x + attn(.), then h + mlp(.), with norms as `norm_layout` says: `pre` (LLaMA) norms
    each branch's input, `sandwich` (Gemma) its input and output, `post` (OLMo 2) its output.
    Granite scales each branch's output by `residual_scale`."""

    def __init__(self, args: ModelArgs, layer: int, mlp: BlockMLP, rope_index: int = 0) -> None:
        super().__init__()
        eps, offset = args.norm_eps, args.norm_unit_offset
        self.layout, self.residual_scale = args.norm_layout, args.residual_scale
        if self.layout != "post":
            self.input_layernorm = RMSNorm(args.dim, eps, offset)
        self.self_attn = Attention(args, layer, rope_index)
        self.post_attention_layernorm = RMSNorm(args.dim, eps, offset)
        if self.layout == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(args.dim, eps, offset)
        if self.layout != "pre":
            self.post_feedforward_layernorm = RMSNorm(args.dim, eps, offset)
        self.mlp = mlp

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        if self.layout == "pre":
            a = self.self_attn(self.input_layernorm(x, ctx), ctx)
            normed, h = self.post_attention_layernorm.add_and_norm(
                a if self.residual_scale is None else a * self.residual_scale, x, ctx
            )
            m = self.mlp(normed, ctx)
            return h + (m if self.residual_scale is None else m * self.residual_scale)
        if self.layout == "post":
            h = x + self.post_attention_layernorm(self.self_attn(x, ctx), ctx)
            return h + self.post_feedforward_layernorm(self.mlp(h, ctx), ctx)
        a = self.self_attn(self.input_layernorm(x, ctx), ctx)
        h = x + self.post_attention_layernorm(a, ctx)
        m = self.mlp(self.pre_feedforward_layernorm(h, ctx), ctx)
        return h + self.post_feedforward_layernorm(m, ctx)

    def weight_target(self, name: str) -> Tensor:
        """A name below `model.layers.N.`: a norm's weight, `self_attn.*` or `mlp.*`."""
        part, _, rest = name.partition(".")
        if part == "self_attn":
            return self.self_attn.weight_target(rest)
        if part == "mlp":
            return self.mlp.weight_target(rest)
        norm = getattr(self, part, None) if part.endswith("layernorm") else None
        if isinstance(norm, RMSNorm) and rest == "weight":
            return norm.weight
        raise KeyError(name)
