"""How a model splits across tensor-parallel ranks, and the sharded layers' collective steps.

Sizes (torch-free arithmetic, the same on every rank):
  * attention heads: KV heads split as evenly as the count allows (the first ranks take one
    more when it does not divide), each rank's query heads are those of its KV heads; with
    fewer KV heads than ranks every KV head is replicated on `size // n_kv_heads` ranks (the
    size must be a multiple) and its query heads split among those ranks;
  * MLP intermediate rows (dense, and each expert's with tensor-parallel MoE): contiguous
    ranges, as even as possible;
  * vocabulary (embedding and LM head): `ceil(V / size)` rows per rank, the last zero-padded;
  * experts with expert parallelism: contiguous ranges of whole experts.

Collectives in the forward (`ctx.comm`): an all-reduce after each row-parallel projection
(o_proj, down_proj, the experts) and after the vocab-parallel embedding lookup, an all-gather
of the LM head's vocabulary slices. With one rank none of this runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from torch import Tensor

    from engine.parallel.communicator import Communicator


class Span(NamedTuple):
    """A contiguous range [start, start + count) of heads, rows or experts."""

    start: int
    count: int  # type: ignore[assignment]  # shadows tuple.count, as a field may

    @property
    def stop(self) -> int:
        return self.start + self.count


def even_span(total: int, size: int, rank: int) -> Span:
    """Rank `rank`'s share of `total` items split over `size` ranks (first ranks take the
    remainder, one each)."""
    base, extra = divmod(total, size)
    return Span(rank * base + min(rank, extra), base + (rank < extra))


class HeadSplit(NamedTuple):
    q: Span
    """This rank's query heads."""
    kv: Span
    """This rank's KV heads (one, replicated, when there are fewer KV heads than ranks)."""


def head_split(n_heads: int, n_kv_heads: int, size: int, rank: int) -> HeadSplit:
    """Which heads rank `rank` computes (module docstring); ValueError for a split that leaves
    a rank without heads."""
    group = n_heads // n_kv_heads  # query heads per KV head
    if n_kv_heads >= size:
        kv = even_span(n_kv_heads, size, rank)
        return HeadSplit(Span(kv.start * group, kv.count * group), kv)
    if size % n_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {size} must divide or be a multiple of the "
            f"model's {n_kv_heads} KV heads"
        )
    replicas = size // n_kv_heads
    if group < replicas:
        raise ValueError(
            f"tensor_parallel_size {size}: each of the {n_kv_heads} KV heads would be "
            f"replicated on {replicas} ranks but has only {group} query heads"
        )
    kv_head = rank // replicas
    part = even_span(group, replicas, rank % replicas)
    return HeadSplit(Span(kv_head * group + part.start, part.count), Span(kv_head, 1))


@dataclass(frozen=True)
class TPShard:
    """One rank's place in a tensor-parallel group, and what the model's layers derive from
    it. Part of the rank's ModelArgs (`args.tp`); None there means no parallelism."""

    rank: int
    size: int
    expert_parallel: bool = False
    """MoE experts split whole across the ranks instead of each expert's rows."""
    n_heads: int = 0
    """The model's query heads (all ranks'); filled in by `engine.models.tp_slices.shard_args`."""
    n_kv_heads: int = 0
    head_dim: int = 0
    vocab_size: int = 0

    def heads(self, rank: int | None = None) -> HeadSplit:
        return head_split(
            self.n_heads, self.n_kv_heads, self.size, self.rank if rank is None else rank
        )

    @property
    def vocab_rows(self) -> int:
        """Rows of this rank's embedding / LM head slice (equal on every rank)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def rows(self, total: int) -> Span:
        """This rank's rows of an MLP's `total` intermediate rows."""
        return even_span(total, self.size, self.rank)

    def experts(self, num_experts: int) -> Span:
        """This rank's experts (expert parallelism; all of them otherwise)."""
        if not self.expert_parallel:
            return Span(0, num_experts)
        if num_experts < self.size:
            raise ValueError(
                f"expert parallelism over {self.size} ranks needs at least as many "
                f"experts, the model has {num_experts}"
            )
        return even_span(num_experts, self.size, self.rank)

    def whole_norm_dims(self, kv: bool) -> int:
        """The q (or k) values one token has over all ranks, replicas counted as often as
        they are held: the denominator of an RMSNorm over all heads (OLMo 2) taken as an
        all-reduced sum of squares."""
        spans = [self.heads(r) for r in range(self.size)]
        return sum((s.kv if kv else s.q).count for s in spans) * self.head_dim


def all_reduce(x: "Tensor", comm: "Communicator | None") -> "Tensor":
    """The sum of `x` over the ranks (in place; `x` itself without a communicator)."""
    if comm is not None:
        comm.all_reduce(x)
    return x


def vocab_parallel_embed(
    weight: "Tensor", ids: "Tensor", shard: TPShard, comm: "Communicator"
) -> "Tensor":
    """Rows of the full embedding at `ids` from each rank's slice: a rank looks up the ids in
    its range (zeros elsewhere), the all-reduce sums them."""
    import torch

    local = ids - shard.vocab_start
    mine = (local >= 0) & (local < shard.vocab_rows)
    x = torch.nn.functional.embedding(torch.where(mine, local, torch.zeros_like(local)), weight)
    x = x * mine[:, None].to(x.dtype)
    return all_reduce(x, comm)


def gather_vocab(logits: "Tensor", shard: TPShard, comm: "Communicator") -> "Tensor":
    """Each rank's logits over its vocabulary slice [n, vocab_rows] -> the full [n, V]."""
    return comm.all_gather(logits.contiguous(), dim=-1)[:, : shard.vocab_size]
