"""A decoder-only model in the HF checkpoint layout the built-in architectures share:
`model.embed_tokens`, `model.layers.N.{input_layernorm, self_attn, post_attention_layernorm,
mlp}` (Gemma adds `pre_feedforward_layernorm` and `post_feedforward_layernorm`), `model.norm`,
`lm_head` (absent when tied). The architectures differ only in options of ModelArgs
(engine/models/config.py, read by engine/models/layers.py); each model file is a subclass
whose `model_args` sets them, and may rename a checkpoint's module (`HF_ALIASES`, e.g.
Mixtral's `block_sparse_moe` is the `mlp`) or build another MLP (`make_mlp`).

The forward pass takes one flattened ragged batch: `input_ids`/`positions` of T tokens from
any mix of sequences and a ForwardContext (engine/models/interface.py: the paged KV pool and
the step's AttentionMetadata). Q/K/V and gate/up projections are fused into one matmul each;
every checkpoint name maps onto the tensor (or row range of a fused one) that holds it through
the modules' `weight_target`, for a whole load and for in-place updates alike.

Tensor parallel (docs/parallelism.md): built from a rank's ModelArgs (`args.tp` set,
engine/models/tp_slices.py) the same classes hold that rank's heads, rows and vocabulary
slice, and with `use_communicator` they all-reduce / all-gather where a layer's output is
a partial one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from types import ModuleType
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from engine.models.config import ModelArgs
from engine.models.interface import CausalLMBase, ForwardContext, FusedKernels
from engine.models.layers import (
    BlockMLP,
    Embedding,
    FeedForward,
    Linear,
    PackedWeight,
    RMSNorm,
    TransformerBlock,
    linear,
    rope_rows,
)
from engine.models.moe import SparseMoE
from engine.models.rope import rope_cache
from engine.parallel.shard import gather_vocab, vocab_parallel_embed
from engine.runner.weights import copy_weights

if TYPE_CHECKING:
    from engine.cpu_kernels import LayerOps
    from engine.parallel.communicator import Communicator

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
#: Checkpoint tensors that hold nothing the model needs (older exports save RoPE tables).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class DecoderLM(CausalLMBase):
    HF_ALIASES: dict[str, str] = {}
    """Checkpoint module name -> this model's, below `model.layers.N.`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # Tensor parallel: each rank holds a slice of the vocabulary (engine/parallel/shard.py).
        vocab = args.vocab_size if args.tp is None else args.tp.vocab_rows
        self.embed_tokens = Embedding(vocab, args.dim)
        # One RoPE table per distinct spec the layers use (Gemma 3: local and global).
        specs = list(dict.fromkeys(args.rope_spec(i) for i in range(args.n_layers)))
        self._rope_specs = specs or [args.rope_spec(0)]
        self.layers = nn.ModuleList(
            TransformerBlock(args, i, self.make_mlp(args, i), specs.index(args.rope_spec(i)))
            for i in range(args.n_layers)
        )
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_unit_offset)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.dim, vocab, bias=False)
        self._min_positions = 0  # rows every RoPE table holds at least (`serve_positions`)
        self.rope_tables = self._rope_tables()
        self.kernels = None  # the `kernels` package when fused Triton ops are on
        # RMSNorm / RoPE / SiLU-and-mul kernels: Triton's or the CPU's.
        self.layer_ops: ModuleType | LayerOps | None = None
        self.lm_head_packed: PackedWeight | None = None  # layers.pack_linears sets it
        # The tensor-parallel communicator (`use_communicator`); None: one rank.
        self.comm: Communicator | None = None

    @classmethod
    def from_config(cls, config: dict) -> "DecoderLM":
        """The model contract's constructor (engine/models/interface.py); parameters
        uninitialised."""
        return cls(cls.model_args(config))

    @classmethod
    def model_args(cls, config: dict) -> ModelArgs:
        """The architecture's ModelArgs from config.json (each model file overrides this)."""
        return ModelArgs.from_hf_config(config)

    def use_communicator(self, comm) -> None:
        """Run as one rank of a tensor-parallel group (`args.tp` set): its layers combine
        their partial results through `comm` (engine/parallel/communicator.py)."""
        if self.args.tp is None or comm.size != self.args.tp.size:
            raise ValueError("use_communicator: the model is not sharded for this group")
        self.comm = comm

    def make_mlp(self, args: ModelArgs, layer: int) -> BlockMLP:
        """The MLP of `layer`: the experts on a mixture-of-experts model's sparse layers."""
        moe = args.moe
        if moe is None or layer not in moe.sparse_layers:
            return FeedForward(args, layer)
        experts = None if args.tp is None else args.tp.experts(moe.num_experts)
        return SparseMoE(
            args.dim,
            moe.num_experts,
            moe.top_k,
            moe.intermediate_size,
            moe.renormalize,
            layer,
            moe.round_routing_weights,
            experts,
        )

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """HF tensors by name, each into the parameter (or row range of a fused one) that
        holds it: a tensor that is a whole parameter becomes it (no copy; the loader casts
        afterwards), parts of fused ones are copied in. Layers past `args.n_layers` are
        skipped; KeyError names an unknown or misshapen tensor, or a parameter no tensor
        filled."""
        by_storage = {p.untyped_storage().data_ptr(): (n, p) for n, p in self.named_parameters()}
        filled: dict[str, int] = {}
        with torch.no_grad():
            for name, tensor in weights:
                target = self._weight_target(name)
                if target is None:
                    continue
                if tuple(tensor.shape) != tuple(target.shape):
                    raise KeyError(
                        f"{name} has shape {tuple(tensor.shape)}, the model's is "
                        f"{tuple(target.shape)}"
                    )
                pname, param = by_storage[target.untyped_storage().data_ptr()]
                if target.shape == param.shape:
                    param.data = tensor
                    by_storage[tensor.untyped_storage().data_ptr()] = (pname, param)
                else:
                    target.copy_(tensor)
                filled[pname] = filled.get(pname, 0) + target.numel()
        for name, param in self.named_parameters():
            if filled.get(name, 0) < param.numel():
                raise KeyError(f"no checkpoint tensor for {name}")

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        """HF-named tensors copied in place, each into the parameter (or the row range of a
        fused one) that holds it."""
        return copy_weights(self._weight_target, weights)

    def _rope_tables(self) -> list[Tensor]:
        """The fp32 `cos | sin` table of each RoPE spec the layers use."""
        return [rope_cache(spec, min_positions=self._min_positions) for spec in self._rope_specs]

    def serve_positions(self, n: int) -> None:
        """Make positions [0, n) runnable: the RoPE tables grow past the trained length when
        the engine serves a longer max_model_len (engine/config.py resolve_max_model_len)."""
        if n > min(len(t) for t in self.rope_tables):
            self._min_positions = n
            device = self.embed_tokens.weight.device
            self.rope_tables = [t.to(device) for t in self._rope_tables()]

    def _apply(self, fn, recurse=True):
        # The RoPE tables stay fp32 whatever the dtype: after any move or cast they are rebuilt
        # (on the CPU, as at construction) and follow the parameters to their device.
        super()._apply(fn, recurse)
        device = self.embed_tokens.weight.device
        self.rope_tables = [t.to(device) for t in self._rope_tables()]
        return self

    def residual(
        self,
        input_ids: Tensor,
        positions: Tensor,
        ctx: ForwardContext,
        num_layers: int | None = None,
    ) -> Tensor:
        """The residual stream after the last layer, [T, dim] (before the final norm).
        `num_layers`: stop after the first N layers (a layer-skip self-draft)."""
        ctx.positions, ctx.rope_cos_sin = positions, self.rope_tables
        ctx.kernels, ctx.layer_ops, ctx.comm = self.kernels, self.layer_ops, self.comm
        if self.layer_ops is None:
            ctx.cos_sin = [rope_rows(table, positions) for table in self.rope_tables]
        if self.comm is None or self.args.tp is None:  # (use_communicator: both or neither)
            x = self.embed_tokens(input_ids)
        else:  # vocab-parallel embedding: each rank's rows, summed
            x = vocab_parallel_embed(self.embed_tokens.weight, input_ids, self.args.tp, self.comm)
        if self.args.embed_scale is not None:
            x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype)
        for layer in self.layers[:num_layers]:
            x = layer(x, ctx)
        return x

    def lm_head_weight(self) -> Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, x: Tensor, ctx: ForwardContext, indices: Tensor | None = None) -> Tensor:
        return self.head_logits(x, ctx, indices).float()

    def head_logits(self, x: Tensor, ctx: ForwardContext, indices: Tensor | None = None) -> Tensor:
        """`logits` before their widening to fp32: in the LM head's dtype where widening is
        all `logits` adds, fp32 where the model scales or caps them."""
        logits = linear(
            self.hidden(x, ctx, indices), self.lm_head_weight(), None, self.lm_head_packed
        )
        if self.comm is not None and self.args.tp is not None:
            # Vocab-parallel LM head: the ranks' slices side by side.
            logits = gather_vocab(logits, self.args.tp, self.comm)
        if self.args.logits_divisor is None and self.args.final_softcap is None:
            return logits
        logits = logits.float()
        if self.args.logits_divisor is not None:
            logits = logits / self.args.logits_divisor
        cap = self.args.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def hidden(self, x: Tensor, ctx: ForwardContext, indices: Tensor | None = None) -> Tensor:
        """The final-normed hidden state at rows `indices` (what pooling and the LM head
        read), in the model's dtype."""
        if indices is not None:
            x = x[indices]
        return self.norm(x, ctx)

    def use_fused_kernels(self, kind: FusedKernels) -> None:
        """Route RMSNorm, RoPE and SiLU-and-mul through the Triton kernels ("triton": CUDA, or
        CPU under TRITON_INTERPRET=1; MoE and LoRA too) or the CPU's C++ ops ("cpu",
        engine/cpu_kernels: they must have loaded); None: plain torch."""
        self.kernels = self.layer_ops = None
        if kind == "triton":
            import kernels

            self.kernels = self.layer_ops = kernels
        elif kind == "cpu":
            from engine.cpu_kernels import LAYER_OPS

            self.layer_ops = LAYER_OPS

    def _weight_target(self, name: str) -> Tensor | None:
        """The tensor (a row range of a fused one) that HF weight `name` lives in; None for a
        layer this (truncated) model does not have or a tensor it does not need; KeyError for
        a name it has no place for."""
        if name == "model.embed_tokens.weight":
            return self.embed_tokens.weight
        if name == "model.norm.weight":
            return self.norm.weight
        if name == "lm_head.weight":
            return self.lm_head_weight()
        if _IGNORED.search(name):
            return None
        m = _HF_LAYER.match(name)
        if m is None:
            raise KeyError(name)
        layer_no, rest = int(m.group(1)), m.group(2)
        if layer_no >= self.args.n_layers:
            return None
        part, dot, tail = rest.partition(".")
        rest = self.HF_ALIASES.get(part, part) + dot + tail
        try:
            return cast(TransformerBlock, self.layers[layer_no]).weight_target(rest)
        except KeyError:
            raise KeyError(name) from None
