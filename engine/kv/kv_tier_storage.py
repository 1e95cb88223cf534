"""Where the KV tier's bytes live (engine/kv/kv_tier.py keeps the map of what is where): host
memory or a mapped file shaped like the pool's blocks, and a fake for tests of the bookkeeping.
Copies are gathered: one call moves a list of blocks."""

from __future__ import annotations

import ctypes
import os
import stat
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.kv.kv_pool import advise_huge_pages


class TierStorage(Protocol):
    """Where the tier's bytes live. `store_many(slots, block_ids)`: pool blocks -> slots;
    `load_many(slots, block_ids)`: slots -> pool blocks, pairwise, distinct destinations.
    Both complete before they return."""

    num_slots: int

    def store_many(self, slots: list[int], block_ids: list[int]) -> None: ...

    def load_many(self, slots: list[int], block_ids: list[int]) -> None: ...


class TierFileRefused(PermissionError):
    """--kv-offloading-path names a file others could read or change (the KV of every
    prompt passes through it)."""


def open_tier_file(path: str) -> int:
    """A read-write descriptor of the tier file `path`: created 0600 (O_EXCL, never through a
    symbolic link), or an existing one adopted only if it is a regular file owned by this
    process's user with no group or other permissions. TierFileRefused (naming the path)
    otherwise."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, flags)
    except OSError as exc:  # a symbolic link (ELOOP), a directory, no permission
        raise TierFileRefused(f"--kv-offloading-path {path}: cannot open it ({exc})") from None
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not this process's user ({os.geteuid()})"
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}: group or others may access it"
    if problem is not None:
        os.close(fd)
        raise TierFileRefused(
            f"--kv-offloading-path {path} {problem}; the KV of every prompt passes through "
            "it: remove it, or give a file of this user with mode 0600"
        )
    return fd


class HostTierStorage:
    """Slots shaped like the pool's blocks, in host memory (pinned when the pool is on a GPU)
    or in a file mapped shared (`path`: scratch space, overwritten, never read back after a
    restart; created 0600 or refused when others could reach it, `open_tier_file`)."""

    def __init__(self, pool: torch.Tensor, num_slots: int, path: str | None = None) -> None:
        self.pool = pool  # the tensor object, not its storage: sleep/wake swap its storage
        self.num_slots = num_slots
        shape = (num_slots, *pool.shape[1:])
        if path is not None:
            numel = 1
            for d in shape:
                numel *= d
            fd = open_tier_file(os.fspath(path))
            try:  # mapped through the descriptor checked, not the name (which could move)
                self.slots = torch.from_file(
                    f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=pool.dtype
                ).view(shape)
            finally:
                os.close(fd)
        else:
            pin = pool.device.type == "cuda"
            self.slots = torch.empty(shape, dtype=pool.dtype, pin_memory=pin)
            if not pin:
                advise_huge_pages(self.slots)
            # Touched now, not by the first demotion into each slot (page faults made those
            # 25-70x slower than a warm copy on a 2-vCPU VM).
            self.slots.zero_()

    def store_many(self, slots: list[int], block_ids: list[int]) -> None:
        _gather_copy(self.slots, slots, self.pool, block_ids)

    def load_many(self, slots: list[int], block_ids: list[int]) -> None:
        _gather_copy(self.pool, block_ids, self.slots, slots)


def _gather_copy(
    dst: torch.Tensor, dst_idx: list[int], src: torch.Tensor, src_idx: list[int]
) -> None:
    """dst[dst_idx[i]] <- src[src_idx[i]] for every i (blocks along dim 0, one dtype).
    Host to host: one memmove per run of blocks adjacent on both sides (`block_runs`) in this
    thread (torch's copy_ and index ops split the work over the intra-op threads, and on a
    busy CPU waiting for them cost milliseconds; measured against index_select/index_copy_ in
    docs/benchmarks/kv_cache.md). Across devices: one gather on the source's device, one
    transfer, one scatter on the destination's."""
    if dst.device.type == src.device.type == "cpu":
        nbytes = src[0].numel() * src.element_size()
        d0, s0 = dst.data_ptr(), src.data_ptr()
        for s, d, n in block_runs(src_idx, dst_idx):
            ctypes.memmove(d0 + d * nbytes, s0 + s * nbytes, n * nbytes)
        return
    gathered = src.index_select(0, torch.tensor(src_idx, device=src.device))
    dst.index_copy_(0, torch.tensor(dst_idx, device=dst.device), gathered.to(dst.device))


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Block copies `src[i] -> dst[i]` (distinct destinations) as (first source, first
    destination, length) runs of blocks adjacent on both sides, ordered by destination."""
    runs: list[tuple[int, int, int]] = []
    for d, s in sorted(zip(dst, src, strict=True)):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


@dataclass
class FakeTierStorage:
    """For tests of the bookkeeping: records which pool block each slot holds a copy of, and
    every copy made."""

    num_slots: int
    held: dict[int, int] = field(default_factory=dict)  # slot -> pool block copied in
    copies: list[tuple[str, int, int]] = field(default_factory=list)  # (op, slot, block)
    batches: list[tuple[str, int]] = field(default_factory=list)  # (op, blocks) per call

    def store_many(self, slots: list[int], block_ids: list[int]) -> None:
        self.batches.append(("store", len(slots)))
        for slot, block_id in zip(slots, block_ids):
            self.held[slot] = block_id
            self.copies.append(("store", slot, block_id))

    def load_many(self, slots: list[int], block_ids: list[int]) -> None:
        self.batches.append(("load", len(slots)))
        for slot, block_id in zip(slots, block_ids):
            self.copies.append(("load", slot, block_id))
