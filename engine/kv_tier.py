"""The KV cache's second tier: a bounded LRU store of block copies behind the pool (host
memory, or a file via mmap), vLLM's KV offloading / SGLang HiCache's host tier.

Life cycle of a block here (engine/block_manager.py drives it):
- demote: the prefix cache evicts a cached block with no users from the pool; instead of
  dropping it, its bytes (one pool block: a KV group's layers, K and V) are copied into a
  free slot here, under (group, block hash). A full tier first evicts its least recently
  demoted or touched entry.
- promote: a prefix lookup that misses the pool finds (group, hash) here; `take` removes the
  entry (its slot is held, so no demotion can overwrite it), the block manager allocates a pool
  block and `load`s the bytes back into it, which frees the slot. A (group, hash) is held by the
  pool's prefix cache or by the tier, never both.

Copies are synchronous, in the engine thread, at schedule time (before the forward that reads
a promoted block or writes an evicted one, and before a decode worker hands a block to a
KV transfer). On CUDA they are device <-> pinned host copies the host waits for (the stream is
idle at schedule time: the previous step synchronised on its samples).
"""
from __future__ import annotations

import ctypes
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.block_hash import BlockHash
from engine.kv_pool import advise_huge_pages

TierKey = tuple[int, BlockHash]
"""(KV group, block hash): one pool block's worth of KV."""


class TierStorage(Protocol):
    """Where the tier's bytes live. `store(slot, block_id)`: pool block -> slot;
    `load(slot, block_id)`: slot -> pool block. Both complete before they return."""

    num_slots: int

    def store(self, slot: int, block_id: int) -> None: ...

    def load(self, slot: int, block_id: int) -> None: ...


class HostTierStorage:
    """Slots shaped like the pool's blocks, in host memory (pinned when the pool is on a GPU)
    or in a file mapped shared (`path`: scratch space, overwritten, never read back after a
    restart)."""

    def __init__(self, pool: torch.Tensor, num_slots: int, path: str | None = None) -> None:
        self.pool = pool  # the tensor object, not its storage: sleep/wake swap its storage
        self.num_slots = num_slots
        shape = (num_slots, *pool.shape[1:])
        if path is not None:
            numel = 1
            for d in shape:
                numel *= d
            with open(path, "ab"):  # exists before it is mapped (from_file sizes it)
                pass
            self.slots = torch.from_file(os.fspath(path), shared=True, size=numel,
                                         dtype=pool.dtype).view(shape)
        else:
            pin = pool.device.type == "cuda"
            self.slots = torch.empty(shape, dtype=pool.dtype, pin_memory=pin)
            if not pin:
                advise_huge_pages(self.slots)
            # Touched now, not by the first demotion into each slot (page faults made those
            # 25-70x slower than a warm copy on a 2-vCPU VM).
            self.slots.zero_()

    def store(self, slot: int, block_id: int) -> None:
        _copy(self.slots[slot], self.pool[block_id])

    def load(self, slot: int, block_id: int) -> None:
        _copy(self.pool[block_id], self.slots[slot])


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src, two contiguous blocks of one dtype. Host to host: one memmove in this
    thread (torch's copy_ splits a block over the intra-op threads, and on a busy CPU waiting
    for them cost milliseconds per block); otherwise torch's copy (the host waits)."""
    if dst.device.type == src.device.type == "cpu":
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:
        dst.copy_(src)


@dataclass
class FakeTierStorage:
    """For tests of the bookkeeping: records which pool block each slot holds a copy of, and
    every copy made."""

    num_slots: int
    held: dict[int, int] = field(default_factory=dict)  # slot -> pool block copied in
    copies: list[tuple[str, int, int]] = field(default_factory=list)  # (op, slot, block)

    def store(self, slot: int, block_id: int) -> None:
        self.held[slot] = block_id
        self.copies.append(("store", slot, block_id))

    def load(self, slot: int, block_id: int) -> None:
        self.copies.append(("load", slot, block_id))


@dataclass
class TierStats:
    demotions: int = 0  # blocks copied in from the pool
    promotions: int = 0  # blocks copied back into the pool (prefix hits in the tier)
    evictions: int = 0  # blocks dropped to make room (the tier's own LRU)
    hit_tokens: int = 0  # prompt tokens served from the tier (part of the prefix cache hits)
    promote_s: float = 0.0  # seconds one promotion's copy took, a running mean (0: none yet)


class KVTier:
    """Bounded LRU map (group, hash) -> slot over a TierStorage. Not thread-safe: the engine
    thread owns it, like the block manager."""

    def __init__(self, storage: TierStorage) -> None:
        if storage.num_slots < 1:
            raise ValueError("the KV offloading tier holds no block: raise --kv-offloading-size")
        self.storage = storage
        self._lru: OrderedDict[TierKey, int] = OrderedDict()  # least recent first
        self._free = list(range(storage.num_slots))[::-1]  # pop() takes slot 0 first
        self.stats = TierStats()

    @property
    def num_slots(self) -> int:
        return self.storage.num_slots

    @property
    def num_used(self) -> int:
        """Slots holding a block (taken ones included until loaded)."""
        return self.num_slots - len(self._free)

    def __contains__(self, key: TierKey) -> bool:
        return key in self._lru

    def keys(self) -> list[TierKey]:
        """Held entries, least recent first."""
        return list(self._lru)

    def touch(self, key: TierKey) -> None:
        """`key` was looked up: it becomes the most recent."""
        self._lru.move_to_end(key)

    def demote(self, key: TierKey, block_id: int) -> tuple[bool, list[TierKey]]:
        """Copy pool block `block_id` in as `key`. Returns (kept, entries evicted to make
        room); not kept only when every slot is taken by a promotion in progress."""
        evicted = []
        if key in self._lru:  # cannot happen (pool and tier are exclusive); keep the newer
            self.discard(key)
        if not self._free:
            if not self._lru:
                return False, evicted
            old, slot = self._lru.popitem(last=False)
            self._free.append(slot)
            self.stats.evictions += 1
            evicted.append(old)
        slot = self._free.pop()
        self.storage.store(slot, block_id)
        self._lru[key] = slot
        self.stats.demotions += 1
        return True, evicted

    def take(self, key: TierKey) -> int:
        """Remove `key` for a promotion; its slot stays held until `load`."""
        return self._lru.pop(key)

    def load(self, slot: int, block_id: int) -> None:
        """Copy a taken slot into pool block `block_id`, freeing the slot."""
        start = time.perf_counter()
        self.storage.load(slot, block_id)
        self._free.append(slot)
        s = self.stats
        s.promotions += 1
        # Exponentially weighted (~ the last 20 promotions), the first one as it came.
        s.promote_s += (time.perf_counter() - start - s.promote_s) / min(s.promotions, 20)

    def discard(self, key: TierKey) -> None:
        """Forget `key` (the pool now holds the same block)."""
        self._free.append(self._lru.pop(key))

    def clear(self) -> list[TierKey]:
        """Forget everything; the entries dropped."""
        keys = list(self._lru)
        for key in keys:
            self.discard(key)
        return keys


def tier_slots(size_bytes: int, block_bytes: int) -> int:
    """Blocks a tier of `size_bytes` holds (whole blocks only)."""
    return size_bytes // block_bytes
