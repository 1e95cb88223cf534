"""Fewer, larger regions: merging a transfer's (source, destination) descriptor pairs.

A transfer plan is pairs of NIXL descriptors (address, length, device), source i written into
destination i. Where pair i + 1 starts, on both sides and on the same devices, exactly where
pair i ends, the two are one region of their summed length: adjacent blocks on both sides
(the block pool hands out runs, engine/kv/block_pool.py `pop_many`), or rows of a slice whose
bytes are contiguous in both pools. The number of descriptors a plan posts is then its number
of runs (docs/benchmarks/kvtransfer.md has what that is worth).

`coalesce` merges neighbours in the order given; callers order their block pairs by source
block first (`by_source`): the order of a write's pairs does not matter, its destinations are
distinct. Where both pools are described block by block in prepared lists, NIXL does the same
merge itself for consecutive indices (kvtransfer/nixl_backend.py); `count_runs` says how many
regions that makes. This module imports numpy only.
"""

from __future__ import annotations

import numpy as np


def by_source(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Block pairs `local[i] -> remote[i]` ordered by source block (stable), so that runs of
    adjacent blocks on both sides are neighbours."""
    order = np.argsort(local, kind="stable")
    return local[order], remote[order]


def coalesce(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Descriptor pairs (rows of (address, length, device), the same lengths on both sides)
    with every run of pairs contiguous on both sides merged into one pair, in order."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source descriptors but {len(dst)} destinations")
    if len(src) < 2:
        return src, dst
    if not np.array_equal(src[:, 1], dst[:, 1]):
        raise ValueError("a pair's source and destination lengths differ")
    ends = src[:-1, 0] + src[:-1, 1]
    joined = (
        (src[1:, 0] == ends)
        & (dst[1:, 0] == dst[:-1, 0] + dst[:-1, 1])
        & (src[1:, 2] == src[:-1, 2])
        & (dst[1:, 2] == dst[:-1, 2])
    )
    if not joined.any():
        return src, dst
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    lengths = np.add.reduceat(src[:, 1], starts)
    out_src, out_dst = src[starts].copy(), dst[starts].copy()
    out_src[:, 1] = lengths
    out_dst[:, 1] = lengths
    return out_src, out_dst


def count_runs(local: np.ndarray, remote: np.ndarray) -> int:
    """Runs of block pairs `local[i] -> remote[i]` adjacent on both sides, in the order given
    (the regions a plan of whole blocks in that order posts)."""
    if len(local) == 0:
        return 0
    breaks = (np.diff(local) != 1) | (np.diff(remote) != 1)
    return 1 + int(np.count_nonzero(breaks))
