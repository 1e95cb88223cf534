"""The KV layout a worker advertises to the router and its peers, and how rank 0's KV transfer
agent reaches the other ranks of a tensor-parallel worker (docs/parallelism.md, "KV transfer
between tensor-parallel sizes")."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvtransfer import KVCompat
from kvtransfer.compat import window_layers
from kvtransfer.heads import HeadRange
from kvtransfer.rank_agent import RankLink

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def kv_layout(engine: LLMEngine) -> KVCompat:
    """The KV layout this worker advertises: the model's whole layout, whatever its
    tensor_parallel_size — a tensor-parallel worker's pools hold the heads `rank_link` names,
    and transfers map them (kvtransfer/heads.py), so peers of any size are compatible."""
    args = engine.loaded.args
    compat = KVCompat.for_pool(
        engine.kv_cache,
        engine.loaded.model_id,
        engine.config.kv_cache_dtype,
        architecture=engine.loaded.architecture,
        layer_windows=window_layers(args.window(i) for i in range(args.n_layers)),
    )
    shard = getattr(args, "tp", None)  # None at tensor_parallel_size 1
    if shard is not None:
        compat = dataclasses.replace(compat, num_kv_heads=shard.n_kv_heads)
    return compat


def rank_link(engine: LLMEngine) -> RankLink | None:
    """How rank 0's KV transfer agent reaches the other ranks (None at tensor_parallel_size 1):
    each rank's KV heads (head_split: from the model and the size) and the group channel."""
    group, shard = engine.parallel_group, engine.loaded.args.tp
    if group is None:
        return None
    assert shard is not None, "a tensor-parallel engine's model args carry its shard"
    ranges = [HeadRange(s.kv.start, s.kv.stop) for s in map(shard.heads, range(group.size))]
    return RankLink(ranges, group.call)
