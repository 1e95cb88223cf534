"""Which KV heads each rank's pool holds, and which bytes move between two groups of ranks.

A worker at tensor_parallel_size N keeps heads `[start, stop)` of every block in rank r's
pool (engine/parallel/shard.py `head_split`, deterministic from the model and N; with fewer KV
heads than ranks several ranks hold the same head). A worker at N = 1 is one pool holding
every head. Moving blocks from a group of Np ranks into a group of Nd ranks:

* `plan_slices`: every destination rank receives exactly its heads, each head from one
  source rank holding it (replicas on the source: one is read, chosen round-robin by
  destination rank; replicas on the destination: each is written). Consecutive heads from
  the same source rank form one `Slice`.
* `slice_descs`: a block is `[heads, num_layers, 2, block_size, stored_head_dim]` in each
  pool (engine/kv/kv_pool.py: heads first), so one head of a block is one contiguous region
  of `num_layers * 2 * block_size * stored_head_dim * element_size` bytes and a slice of a
  block — consecutive heads — is ONE region on each side: one descriptor per (block, slice),
  whatever the two tensor-parallel sizes. When the slice is both pools' every head (equal
  splits; N = 1 to N = 1) the region is the whole block, and a run of blocks adjacent in both
  pools merges into one region.

This module imports neither torch nor NIXL (the router and tests use it as is).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where descriptors are built: metadata stays light
    import numpy as np


@dataclass(frozen=True, slots=True)
class HeadRange:
    """KV heads [start, stop) of the model that one rank's pool holds, in this order."""

    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start

    def __contains__(self, head: int) -> bool:
        return self.start <= head < self.stop


@dataclass(frozen=True, slots=True)
class Slice:
    """Heads that move from one source rank's pool into one destination rank's pool."""

    src_rank: int
    dst_rank: int
    src_head: int
    """First head, counted within the source rank's pool."""
    dst_head: int
    """First head, counted within the destination rank's pool."""
    num_heads: int
    whole: bool
    """The slice is every head of both pools: a block is one contiguous region on each side."""


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """Where one rank's pool is, for descriptors: block b starts at `base + b * block_bytes`,
    and head h of it (counted within this pool) `h * head_region_bytes` further."""

    base_addr: int
    num_heads: int
    device_id: int
    rows: int
    """num_layers * 2 * block_size: the rows of one head of a block (consecutive)."""
    head_bytes: int
    """Bytes of one head's values in one row (stored_head_dim * element size)."""

    @property
    def head_region_bytes(self) -> int:
        """One head of one block: its rows, one contiguous region."""
        return self.rows * self.head_bytes

    @property
    def block_bytes(self) -> int:
        return self.num_heads * self.head_region_bytes


def check_ranges(ranges: Sequence[HeadRange], num_kv_heads: int) -> None:
    """ValueError unless every range lies in [0, num_kv_heads), is non-empty, and together
    they hold every head."""
    held: set[int] = set()
    for r in ranges:
        if not 0 <= r.start < r.stop <= num_kv_heads:
            raise ValueError(
                f"head range [{r.start}, {r.stop}) is not within the model's "
                f"{num_kv_heads} KV heads"
            )
        held.update(range(r.start, r.stop))
    if len(held) != num_kv_heads:
        raise ValueError(f"the ranks' pools hold heads {sorted(held)}, not all {num_kv_heads}")


def plan_slices(src: Sequence[HeadRange], dst: Sequence[HeadRange]) -> list[Slice]:
    """The slices that give every destination rank its heads (module docstring), ordered by
    destination rank, then head. ValueError if a destination head has no source."""
    out: list[Slice] = []
    for j, d in enumerate(dst):
        run: list[int] | None = None  # [src rank, first head (model), count]
        for h in range(d.start, d.stop):
            holders = [i for i, s in enumerate(src) if h in s]
            if not holders:
                raise ValueError(f"no source rank holds KV head {h}")
            i = holders[j % len(holders)]
            if run is not None and run[0] == i and run[1] + run[2] == h:
                run[2] += 1
                continue
            if run is not None:
                out.append(_slice(src, dst, j, *run))
            run = [i, h, 1]
        if run is not None:
            out.append(_slice(src, dst, j, *run))
    return out


def _slice(
    src: Sequence[HeadRange], dst: Sequence[HeadRange], j: int, i: int, head: int, count: int
) -> Slice:
    whole = count == src[i].count == dst[j].count
    return Slice(i, j, head - src[i].start, head - dst[j].start, count, whole)


def slice_descs(
    s: Slice, src: PoolGeometry, dst: PoolGeometry, local: np.ndarray, remote: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """NIXL descriptors (address, length, device) of slice `s` of blocks `local` (source pool)
    -> `remote` (destination pool), paired by index, coalesced (kvtransfer/coalesce.py): the
    pairs in source block order, then one region per run of blocks adjacent in both pools
    for a whole slice, else one region per block (the slice's heads of it)."""
    import numpy as np

    from kvtransfer.coalesce import by_source, coalesce

    local, remote = by_source(np.asarray(local), np.asarray(remote))
    if s.whole:
        return coalesce(
            _descs(
                src.base_addr + local.astype(np.uint64) * np.uint64(src.block_bytes),
                src.block_bytes,
                src.device_id,
            ),
            _descs(
                dst.base_addr + remote.astype(np.uint64) * np.uint64(dst.block_bytes),
                dst.block_bytes,
                dst.device_id,
            ),
        )
    if src.head_region_bytes != dst.head_region_bytes:
        raise ValueError(
            f"a head of a block is {src.head_region_bytes} bytes in the source pool but "
            f"{dst.head_region_bytes} in the destination's"
        )
    length = s.num_heads * src.head_region_bytes
    return coalesce(
        _pieces(src, local, s.src_head, length),
        _pieces(dst, remote, s.dst_head, length),
    )


def _pieces(pool: PoolGeometry, blocks: np.ndarray, head: int, length: int) -> np.ndarray:
    """One region per block: `length` bytes from head `head` of it."""
    import numpy as np

    addr = np.uint64(pool.base_addr + head * pool.head_region_bytes) + blocks.astype(
        np.uint64
    ) * np.uint64(pool.block_bytes)
    return _descs(addr, length, pool.device_id)


def _descs(addr: np.ndarray, length: int, device_id: int) -> np.ndarray:
    import numpy as np

    descs = np.empty((len(addr), 3), dtype=np.uint64)
    descs[:, 0] = addr
    descs[:, 1] = length
    descs[:, 2] = device_id
    return descs
