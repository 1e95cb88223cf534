"""The sparse mixture-of-experts MLP of Mixtral and Qwen3-MoE, and where its checkpoint
tensors go.

Routing is transformers' (5.x MixtralTopKRouter / Qwen3MoeTopKRouter): router logits in the
model dtype, softmax in fp32, top-k, the k weights re-normalised to sum 1 when `renormalize`
(Mixtral always, Qwen3-MoE with `norm_topk_prob`); Qwen3-MoE then rounds them to the model
dtype, Mixtral keeps them fp32 (`round_routing_weights`). Each expert is a SwiGLU MLP; the
experts are stacked: `w13` [E, 2I, D] (each expert's gate rows, then its up rows) and `w2`
[E, D, I]. Expert outputs are scaled in fp32 and summed over top-k in fp32, rounded once.

Two paths, same contract:
  * torch (CPU): the T * top_k (token, expert) assignments sorted by expert; one matmul pair
    per expert that has tokens, over its contiguous slice; one `index_add_` back.
  * `ctx.kernels` set: kernels.fused_moe (grouped Triton GEMMs, no host sync).
No LoRA on experts: the model refuses adapters that target them, so `ctx.lora` is not read.

Tensor parallel (engine/parallel): each rank holds every expert's slice of intermediate rows
(`w13` [E, 2I/N, D], `w2` [E, D, I/N]) or, with expert parallelism, whole experts
`first .. first + E/N - 1` (renumbered from 0 here, the router still scores all E); either
way a rank's output is a partial sum over its rows or experts and the all-reduce completes it.
Expert parallelism runs the torch path (its assignments filtered to the rank's experts).

Checkpoint names, relative to the MoE block (`model.layers.L.block_sparse_moe.` in Mixtral
checkpoints — the model maps that module name onto `mlp` —, `model.layers.L.mlp.` in
Qwen3-MoE ones and in transformers 5's own layout), through `SparseMoE.weight_target` (the
model's `load_weights` and `update_weights` both use it):
    gate.weight                                  -> gate.weight            [E, D]
    experts.N.w1.weight | experts.N.gate_proj.weight -> w13[N, :I]
    experts.N.w3.weight | experts.N.up_proj.weight   -> w13[N, I:]
    experts.N.w2.weight | experts.N.down_proj.weight -> w2[N]
    experts.gate_up_proj                         -> w13 (all experts; transformers 5 in memory)
    experts.down_proj                            -> w2
transformers 5.24's `save_pretrained` writes the per-expert names (Mixtral under
`block_sparse_moe` with w1/w2/w3; Qwen3-MoE under `mlp` with gate/up/down_proj), as published
checkpoints have them; the fused names appear only with `save_original_format=False`.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models.interface import ForwardContext
from engine.models.layers import Linear
from engine.parallel.shard import Span, all_reduce

_EXPERT_NAME = re.compile(r"^experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_PART = {
    "w1": "gate",
    "gate_proj": "gate",
    "w3": "up",
    "up_proj": "up",
    "w2": "down",
    "down_proj": "down",
}


class WeightSlot(NamedTuple):
    """Where a checkpoint tensor of the MoE block lives."""

    param: str
    """"gate" (the router), "w13" or "w2"."""
    expert: int | None
    """The expert's index in the stack; None: the whole parameter."""
    rows: slice | None
    """Rows of w13[expert]: the gate half [0, I) or the up half [I, 2I); None: all rows."""


def expert_weight_slot(local_name: str, moe_intermediate_size: int) -> WeightSlot:
    """The slot of a block-relative checkpoint name (table in the module docstring);
    KeyError for a name the block has no place for."""
    if local_name == "gate.weight":
        return WeightSlot("gate", None, None)
    if local_name == "experts.gate_up_proj":
        return WeightSlot("w13", None, None)
    if local_name == "experts.down_proj":
        return WeightSlot("w2", None, None)
    m = _EXPERT_NAME.match(local_name)
    if m is None:
        raise KeyError(local_name)
    expert, part, inter = int(m.group(1)), _PART[m.group(2)], moe_intermediate_size
    if part == "down":
        return WeightSlot("w2", expert, None)
    return WeightSlot("w13", expert, slice(0, inter) if part == "gate" else slice(inter, 2 * inter))


def route(
    logits: Tensor, top_k: int, renormalize: bool, dtype: torch.dtype | None
) -> tuple[Tensor, Tensor]:
    """transformers' top-k router on logits [T, E]: (weights [T, top_k], expert ids [T, top_k]).
    Weights are fp32, or rounded to `dtype` when given (Qwen3-MoE)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if dtype is None else weights.to(dtype)), ids


def grouped_moe(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    weights: Tensor,
    ids: Tensor,
    first_expert: int | None = None,
) -> Tensor:
    """The experts in torch, grouped by expert (kernels.fused_moe's contract, x [T, D] ->
    [T, D]). One host read of the per-expert counts; a Python loop over experts with tokens.
    `first_expert` (expert parallelism): `w13`/`w2` hold experts first_expert.. only, and
    only the assignments to them are computed (a partial sum)."""
    num_tokens, top_k = ids.shape
    inter = w2.shape[2]
    flat = ids.reshape(-1)
    if first_expert is None:
        order = torch.argsort(flat, stable=True)  # assignment numbers t * top_k + k, by expert
    else:
        flat = flat - first_expert
        kept = ((flat >= 0) & (flat < w13.shape[0])).nonzero().squeeze(1)
        order = kept[torch.argsort(flat[kept], stable=True)]
        flat = flat[kept]
    tokens = order // top_k
    xs = x[tokens]
    ys = torch.empty((order.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=w13.shape[0]).tolist()):
        if n:
            gate, up = (xs[start : start + n] @ w13[e].T).split([inter, inter], dim=-1)
            ys[start : start + n] = (F.silu(gate) * up) @ w2[e].T
            start += n
    scaled = ys.float() * weights.reshape(-1)[order, None].float()
    out = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
    return out.index_add_(0, tokens, scaled).to(x.dtype)


class SparseMoE(nn.Module):
    """Router + stacked SwiGLU experts of one decoder layer. Parameters: `gate` (Linear
    dim -> E, no bias), `w13` [E, 2I, dim], `w2` [E, dim, I]; all uninitialised until loaded.
    Activation is SiLU (`hidden_act: silu` in both architectures)."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        moe_intermediate_size: int,
        renormalize: bool,
        layer: int,
        round_routing_weights: bool = False,
        experts: Span | None = None,
    ) -> None:
        """`experts`: the experts this rank holds (expert parallelism); None: all."""
        super().__init__()
        self.layer, self.num_experts, self.top_k = layer, num_experts, top_k
        self.inter, self.renormalize = moe_intermediate_size, renormalize
        self.round_routing_weights = round_routing_weights  # Qwen3-MoE: True; Mixtral: False
        experts = experts or Span(0, num_experts)
        self.first_expert = experts.start if experts.count < num_experts else None
        self.gate = Linear(dim, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(experts.count, 2 * moe_intermediate_size, dim))
        self.w2 = nn.Parameter(torch.empty(experts.count, dim, moe_intermediate_size))

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        weights, ids = route(
            self.gate(x),
            self.top_k,
            self.renormalize,
            x.dtype if self.round_routing_weights else None,
        )
        if ctx.kernels is not None and self.first_expert is None:
            out = ctx.kernels.fused_moe(x, self.w13, self.w2, weights, ids)
        else:
            out = grouped_moe(x, self.w13, self.w2, weights, ids, self.first_expert)
        return all_reduce(out, ctx.comm)  # tensor / expert parallel: the ranks' parts summed

    def weight_target(self, local_name: str) -> Tensor:
        """The view of the parameter (an expert, a row range of one) that block-relative
        checkpoint tensor `local_name` is copied into; KeyError for a name with no place."""
        slot = expert_weight_slot(local_name, self.inter)
        target = {"gate": self.gate.weight, "w13": self.w13, "w2": self.w2}[slot.param]
        if slot.expert is not None:
            if slot.expert >= self.w13.shape[0]:
                raise KeyError(local_name)
            target = target[slot.expert]
        return target if slot.rows is None else target[slot.rows]
