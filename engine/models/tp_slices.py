"""Which part of each checkpoint tensor a tensor-parallel rank holds, and its ModelArgs.

`shard_args(args, shard)` gives a rank's ModelArgs: its query and KV heads, its MLP rows (its
experts' rows with tensor-parallel MoE), `tp` set (the vocabulary and expert ranges are
derived from it, engine/parallel/shard.py). `slice_weights` turns the checkpoint's tensors
into that rank's, by checkpoint name (below `model.layers.N.`; Mixtral's `block_sparse_moe`
like `mlp`):

| tensor | column-/row-parallel | rank's part |
|---|---|---|
| embed_tokens, lm_head | vocab-parallel | rows [vocab_start, +vocab_rows), zero-padded |
| q_proj / k_proj / v_proj (weight, bias) | column | its q / kv heads' rows |
| qkv_proj (Phi-3 fused) | column | q, k, v parts each sliced, re-fused |
| o_proj.weight | row | its q heads' columns |
| o_proj.bias | row | whole on rank 0, zeros elsewhere (added once by the all-reduce) |
| q_norm / k_norm, whole-heads (OLMo 2) | column | its heads' values |
| gate_proj / up_proj (gate_up_proj fused) | column | its intermediate rows |
| down_proj | row | its intermediate columns |
| experts.N.* (tensor-parallel MoE) | as dense | each expert's rows / columns |
| experts.N.* (expert parallelism) | whole experts | its experts only, renumbered from 0 |
| experts.gate_up_proj / experts.down_proj (fused) | either | the same, on the stacked tensor |
| norms, per-head q/k norms, the router `gate` | replicated | whole |
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from engine.models.config import ModelArgs, MoEArgs
from engine.parallel.shard import Span, TPShard

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp|block_sparse_moe)\.(.+)$")
_EXPERT = re.compile(r"^experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def shard_args(args: ModelArgs, shard: TPShard) -> ModelArgs:
    """The ModelArgs of rank `shard.rank` of a model whose full ModelArgs are `args`."""
    shard = dataclasses.replace(
        shard,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab_size,
    )
    heads = shard.heads()  # ValueError for a split that leaves a rank without heads
    moe = args.moe
    if moe is not None:
        shard.experts(moe.num_experts)  # checks there are enough experts to split
        if not shard.expert_parallel:
            moe = dataclasses.replace(
                moe, intermediate_size=shard.rows(moe.intermediate_size).count
            )
    return dataclasses.replace(
        args,
        n_heads=heads.q.count,
        n_kv_heads=heads.kv.count,
        intermediate_size=shard.rows(args.intermediate_size).count,
        moe=moe,
        tp=shard,
    )


def slice_weights(
    weights: Iterable[tuple[str, Tensor]], args: ModelArgs, shard: TPShard
) -> Iterator[tuple[str, Tensor]]:
    """The rank's (name, tensor) for each checkpoint (name, tensor); tensors the rank does
    not hold (other ranks' experts) are left out. `args`: the full model's; `shard` as
    `shard_args` filled it (`args.tp` of the rank's ModelArgs)."""
    for name, tensor in weights:
        sliced = _slice(name, tensor, args, shard)
        if sliced is not None:
            yield sliced


def _rows(t: Tensor, span: Span, dim: int = 0) -> Tensor:
    return t.narrow(dim, span.start, span.count).contiguous()


def _slice(name: str, t: Tensor, args: ModelArgs, shard: TPShard) -> tuple[str, Tensor] | None:
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = t[shard.vocab_start : shard.vocab_start + shard.vocab_rows]
        if rows.shape[0] < shard.vocab_rows:
            pad = t.new_zeros((shard.vocab_rows - rows.shape[0], *t.shape[1:]))
            rows = torch.cat((rows, pad))
        return name, rows.contiguous()
    m = _LAYER.match(name)
    if m is None:
        return name, t
    layer, module, rest = int(m.group(1)), m.group(2), m.group(3)
    if module == "self_attn":
        return name, _attention(rest, t, args, shard)
    if args.moe is None or layer not in args.moe.sparse_layers:
        return name, _mlp(rest, t, shard.rows(args.intermediate_size))
    local = _experts(rest, t, args.moe, shard)
    return None if local is None else (f"model.layers.{layer}.{module}.{local[0]}", local[1])


def _attention(rest: str, t: Tensor, args: ModelArgs, shard: TPShard) -> Tensor:
    heads, hd = shard.heads(), args.head_dim
    q = Span(heads.q.start * hd, heads.q.count * hd)
    kv = Span(heads.kv.start * hd, heads.kv.count * hd)
    proj, _, kind = rest.partition(".")
    if proj == "q_proj":
        return _rows(t, q)
    if proj in ("k_proj", "v_proj"):
        return _rows(t, kv)
    if proj == "qkv_proj":
        qs, kvs = args.n_heads * hd, args.n_kv_heads * hd
        pq, pk, pv = t.split([qs, kvs, kvs])
        return torch.cat((_rows(pq, q), _rows(pk, kv), _rows(pv, kv)))
    if proj == "o_proj":
        if kind == "bias":
            return t.clone() if shard.rank == 0 else torch.zeros_like(t)
        return _rows(t, q, dim=1)
    if proj in ("q_norm", "k_norm") and args.qk_norm_whole:
        return _rows(t, q if proj == "q_norm" else kv)
    return t  # per-head q/k norms: replicated


def _mlp(rest: str, t: Tensor, rows: Span) -> Tensor:
    if rest in ("gate_proj.weight", "up_proj.weight"):
        return _rows(t, rows)
    if rest == "gate_up_proj.weight":
        gate, up = t.chunk(2)
        return torch.cat((_rows(gate, rows), _rows(up, rows)))
    if rest == "down_proj.weight":
        return _rows(t, rows, dim=1)
    raise KeyError(f"unexpected MLP tensor {rest!r}")


def _experts(rest: str, t: Tensor, moe: MoEArgs, shard: TPShard) -> tuple[str, Tensor] | None:
    """(block-relative name, tensor) of an MoE tensor on this rank; None: another rank's."""
    if rest == "gate.weight":
        return rest, t
    if shard.expert_parallel:
        mine = shard.experts(moe.num_experts)
        if rest in ("experts.gate_up_proj", "experts.down_proj"):
            return rest, _rows(t, mine)
        m = _EXPERT.match(rest)
        if m is None:
            raise KeyError(f"unexpected MoE tensor {rest!r}")
        expert = int(m.group(1))
        if not mine.start <= expert < mine.stop:
            return None
        return f"experts.{expert - mine.start}.{m.group(2)}.weight", t
    rows = shard.rows(moe.intermediate_size)
    if rest == "experts.gate_up_proj":  # [E, 2I, D]
        gate, up = t.chunk(2, dim=1)
        return rest, torch.cat((_rows(gate, rows, 1), _rows(up, rows, 1)), dim=1)
    if rest == "experts.down_proj":  # [E, D, I]
        return rest, _rows(t, rows, dim=2)
    m = _EXPERT.match(rest)
    if m is None:
        raise KeyError(f"unexpected MoE tensor {rest!r}")
    if m.group(2) in ("w2", "down_proj"):
        return rest, _rows(t, rows, dim=1)
    return rest, _rows(t, rows)
