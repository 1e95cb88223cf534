"""The model contract: what the engine calls on a model, and a base class for out-of-tree ones.

The engine runs one flattened ragged batch per step (`input_ids`/`positions` of T tokens from
any mix of prefills, chunks and decodes) and splits the forward in two so that it can read the
final hidden state (pooling) and the logits only at the rows it needs:

    x = model.residual(input_ids, positions, ctx)      # [T, dim], before the final norm
    h = model.hidden(x, ctx, rows)                     # final-normed, for pooling
    logits = model.logits(x, ctx, rows)                # [len(rows), vocab] fp32

Attention goes through the engine's paged attention layer — never a private KV cache:

    o = ctx.backend.forward(q, k, v, ctx.kv_cache, layer, ctx.metadata, scale,
                            sliding_window=None, logits_soft_cap=None)  # per-layer options

with q [T, n_heads, head_dim], k/v [T, n_kv_heads, head_dim] (RoPE applied). The backend
stores k/v in the engine's pool at `ctx.metadata.slot_mapping` and attends over each
sequence's blocks, so prefix caching, chunked prefill, preemption and P/D KV transfer work
for any model that follows this. The pool's shape comes from `args` (ModelArgs: n_layers,
n_kv_heads, head_dim), the context length from `args.max_position_embeddings`.
docs/models.md has the whole story.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from torch import Tensor, nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.lora.batch import LoRABatch
from engine.models.config import ModelArgs

if TYPE_CHECKING:
    from engine.cpu_kernels import LayerOps
    from engine.parallel.communicator import Communicator

FusedKernels = Literal["triton", "cpu"] | None
"""Which fused layer kernels a model runs (`use_fused_kernels`)."""


class ForwardContext:
    """Per-forward state every layer reads: attention backend, pool, batch metadata, the
    step's LoRA adapters. The model fills in what its layers share (positions, its RoPE
    tables and their rows at `positions` — one per RoPE spec the layers use —, the fused
    kernels) at the start of `residual`: `layer_ops` (RMSNorm, RoPE, SiLU-and-mul: the Triton
    package, or the CPU's C++ ops, engine/cpu_kernels) and `kernels` (the Triton package,
    for MoE and LoRA; None on the CPU), and `comm`: its tensor-parallel communicator
    (engine/parallel/communicator.py; None with one rank).

    KV groups (engine/kv/kv_groups.py): when the model's layers share the pool's blocks in
    several groups, `group_metadata[g]` is group g's metadata (its slots and block tables;
    `metadata` is group 0's) and a layer attends with `layer_metadata(group)` at its slot in
    the group's blocks. With one group, `group_metadata` is None."""

    __slots__ = (
        "backend",
        "kv_cache",
        "metadata",
        "group_metadata",
        "positions",
        "rope_cos_sin",
        "cos_sin",
        "kernels",
        "layer_ops",
        "lora",
        "comm",
    )

    def __init__(
        self,
        backend: AttentionBackend,
        kv_cache: Tensor,
        metadata: AttentionMetadata,
        lora: LoRABatch | None = None,
        group_metadata: list[AttentionMetadata] | None = None,
    ):
        self.backend, self.kv_cache, self.metadata = backend, kv_cache, metadata
        self.group_metadata = group_metadata
        self.positions: Tensor | None = None
        self.rope_cos_sin: list[Tensor] | None = None
        self.cos_sin: list[tuple[Tensor, Tensor]] | None = None
        self.kernels: ModuleType | None = None
        self.layer_ops: ModuleType | LayerOps | None = None
        self.lora = lora  # the step's adapters (engine/lora/batch.py); None: no row has one
        # The tensor-parallel group's communicator (engine/parallel); None: one rank.
        self.comm: Communicator | None = None

    @classmethod
    def for_groups(
        cls,
        backend: AttentionBackend,
        kv_cache: Tensor,
        metadata: list[AttentionMetadata],
        lora: LoRABatch | None = None,
    ) -> "ForwardContext":
        """A context over one metadata per KV group."""
        return cls(backend, kv_cache, metadata[0], lora, metadata if len(metadata) > 1 else None)

    def layer_metadata(self, group: int) -> AttentionMetadata:
        return self.metadata if self.group_metadata is None else self.group_metadata[group]


@runtime_checkable
class CausalLM(Protocol):
    """What the engine (runner, draft proposer, LoRA, KV pool sizing) calls on a model.
    Implementations are `nn.Module`s; the loader moves them to the device and dtype."""

    args: ModelArgs
    """Sizes the engine reads: the KV pool (n_layers, n_kv_heads, head_dim), the vocabulary,
    the context length, LoRA shapes (dim, n_heads, intermediate_size)."""
    kernels: ModuleType | None
    """The `kernels` package when fused Triton ops are on (LoRA reads it), else None."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CausalLM":
        """Build the module from the checkpoint's config.json (weights uninitialised or
        random: `load_weights` replaces them)."""

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Take the checkpoint's tensors, by their names in the checkpoint. Names of layers
        past `args.n_layers` (the loader's `num_layers` cut) must be skipped."""

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        """Copy checkpoint-named tensors (any subset, e.g. a trainer's new policy) into the
        live parameters; returns how many were applied. Raises ValueError for a name or shape
        that does not fit, before anything is copied."""

    def residual(
        self,
        input_ids: Tensor,
        positions: Tensor,
        ctx: ForwardContext,
        num_layers: int | None = None,
    ) -> Tensor:
        """[T, dim] after the first `num_layers` (default all) layers, before the final norm."""

    def hidden(self, x: Tensor, ctx: ForwardContext, indices: Tensor | None = None) -> Tensor:
        """The final-normed hidden state at rows `indices` of `x`, in the model's dtype."""

    def logits(self, x: Tensor, ctx: ForwardContext, indices: Tensor | None = None) -> Tensor:
        """LM-head logits [len(indices) or T, vocab], fp32, at rows `indices` of `x`.
        A model may also define `head_logits(x, ctx, indices)`: the same logits before they
        are widened to fp32 (`logits` must equal `head_logits(...).float()`); the engine then
        skips that copy where its sampler reads the LM head's dtype (engine/sampling/sampler.py)."""

    def use_fused_kernels(self, kind: FusedKernels) -> None:
        """The engine asks for "triton" with the Triton attention backend, "cpu" on the CPU
        where the C++ ops build, None for plain torch; a model may ignore it."""

    def use_communicator(self, comm: Communicator) -> None:
        """Run as one rank of a tensor-parallel group (the loader sharded it: `args.tp` set);
        the engine calls it only at tensor_parallel_size > 1. Raises ValueError where the
        model is not sharded for `comm`'s group."""

    # The nn.Module methods the engine uses (sleep mode, weight updates, packing).
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]: ...

    def __call__(
        self,
        input_ids: Tensor,
        positions: Tensor,
        ctx: ForwardContext,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """`logits(residual(input_ids, positions, ctx), ctx, logits_indices)`."""


class CausalLMBase(nn.Module):
    """A base for out-of-tree models: implement `from_config`, `load_weights`, `residual` and
    `hidden`; `forward`, `logits` (the tied or separate LM head at `lm_head_weight()`),
    `update_weights` (through `load_weights`) and the vLLM-style names come from here."""

    args: ModelArgs
    kernels: ModuleType | None = None

    if TYPE_CHECKING:  # a subclass implements these (see `CausalLM`)

        def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None: ...

        def residual(
            self,
            input_ids: Tensor,
            positions: Tensor,
            ctx: ForwardContext,
            num_layers: int | None = None,
        ) -> Tensor: ...

        def hidden(
            self, x: Tensor, ctx: ForwardContext, indices: Tensor | None = None
        ) -> Tensor: ...

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        ctx: ForwardContext,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """Logits at the rows asked for (all rows by default), fp32."""
        return self.logits(self.residual(input_ids, positions, ctx), ctx, logits_indices)

    def logits(self, x: Tensor, ctx: ForwardContext, indices: Tensor | None = None) -> Tensor:
        return nn.functional.linear(self.hidden(x, ctx, indices), self.lm_head_weight()).float()

    def compute_logits(
        self, x: Tensor, ctx: ForwardContext, indices: Tensor | None = None
    ) -> Tensor:
        """vLLM's name for `logits`."""
        return self.logits(x, ctx, indices)

    def lm_head_weight(self) -> Tensor:
        raise NotImplementedError

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        """`load_weights` with what is given (it must accept a subset to update one)."""
        weights = list(weights)
        self.load_weights(weights)
        return len(weights)

    def use_fused_kernels(self, kind: FusedKernels) -> None:
        """Plain torch ops whatever the backend (attention still runs in the backend)."""
        self.kernels = None
