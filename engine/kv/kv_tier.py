"""The KV cache's second tier: a bounded LRU store of block copies behind the pool (host
memory, or a file via mmap), vLLM's KV offloading / SGLang HiCache's host tier.

Life cycle of a block here (engine/kv/block_pool.py drives it; engine/kv/block_manager.py swaps):
- demote: the prefix cache evicts a cached block with no users from the pool; instead of
  dropping it, its bytes (one pool block: a KV group's layers, K and V) are copied into a
  free slot here, under (group, block hash). A full tier first evicts its least recently
  demoted or touched entry.
- promote: a prefix lookup that misses the pool finds (group, hash) here; `take` removes the
  entry (its slot is held, so no demotion can overwrite it), the block pool takes a free
  block and `load`s the bytes back into it, which frees the slot. A (group, hash) is held by the
  pool's prefix cache or by the tier, never both.
- swap: a preempted request's partial last block (computed tokens past its last full one, no
  hash) is copied in under (group, request id) by `swap_out`, held outside the LRU (never
  evicted) until `swap_in` loads it back into the resumed request's block or `drop_swapped`
  forgets it (the request finished, or resumed without it). The (group, hash) entries it
  resumes after are `pin`ned meanwhile: the LRU evicts around them (they may still be
  promoted by a hit, and demoted again).

Copies run in the engine thread, before the forward that reads a promoted block or writes an
evicted one, and before a decode worker hands a block to a KV transfer. Outside `batch()` each
copy completes before its call returns; inside it they are queued and `flush` (at the end of
the outermost batch: the engine batches each step's schedule) runs them as one gathered store
then one gathered load. Queue invariants: every store precedes every load (an evicted block may
be a promotion's destination, a slot demoted into may be promoted from in the same batch), and
a loaded slot stays held until the flush (no queued store may overwrite it before it is read).
On CUDA the copies are device <-> pinned host copies the host waits for (the stream is idle at
schedule time: the previous step synchronised on its samples). Every flush measures its
seconds per block (`copy_times`), which the scheduler weighs against recomputing.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from engine.kv.block_hash import BlockHash
from engine.kv.kv_tier_storage import FakeTierStorage, HostTierStorage, TierStorage

__all__ = [
    "CopyTimes",
    "FakeTierStorage",
    "HostTierStorage",
    "KVTier",
    "SwapKey",
    "TierKey",
    "TierStats",
    "TierStorage",
    "tier_slots",
]

TierKey = tuple[int, BlockHash]
"""(KV group, block hash): one pool block's worth of KV."""
SwapKey = tuple[int, str]
"""(KV group, request id): a preempted request's partial last block."""
COPY_EWMA_WEIGHT = 0.2  # weight of the newest flush in the per-block copy times


@dataclass
class CopyTimes:
    """Measured seconds per block of the tier's copies (exponentially weighted over recent
    flushes); 0.0: not measured yet."""

    store_s: float = 0.0  # pool -> tier
    load_s: float = 0.0  # tier -> pool

    def observe(self, op: str, seconds: float, blocks: int) -> None:
        old = getattr(self, op)
        per = seconds / blocks
        setattr(self, op, per if old == 0.0 else old + COPY_EWMA_WEIGHT * (per - old))


@dataclass
class TierStats:
    demotions: int = 0  # blocks copied in from the pool
    promotions: int = 0  # blocks copied back into the pool (prefix hits in the tier)
    evictions: int = 0  # blocks dropped to make room (the tier's own LRU)
    hit_tokens: int = 0  # prompt tokens served from the tier (part of the prefix cache hits)
    swap_outs: int = 0  # preempted requests whose partial blocks were swapped out
    swap_ins: int = 0  # of which resumed from them (not recomputing those tokens)


class KVTier:
    """Bounded LRU map (group, hash) -> slot over a TierStorage. Not thread-safe: the engine
    thread owns it, like the block pool."""

    def __init__(self, storage: TierStorage) -> None:
        if storage.num_slots < 1:
            raise ValueError("the KV offloading tier holds no block: raise --kv-offloading-size")
        self.storage = storage
        self._lru: OrderedDict[TierKey, int] = OrderedDict()  # least recent first
        self._swapped: dict[SwapKey, int] = {}  # held outside the LRU until swapped in
        self._pinned: dict[TierKey, int] = {}  # key -> swapped-out requests resuming after it
        self._free = list(range(storage.num_slots))[::-1]  # pop() takes slot 0 first
        self._stores: dict[int, int] = {}  # queued: slot -> pool block (the latest per slot)
        self._loads: list[tuple[int, int]] = []  # queued: (slot, pool block)
        self._depth = 0  # nesting of batch()
        self.stats = TierStats()
        self.copy_times = CopyTimes()

    @property
    def num_slots(self) -> int:
        return self.storage.num_slots

    @property
    def num_used(self) -> int:
        """Slots holding a block (taken ones until loaded, swapped-out ones included)."""
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
        room); not kept only when every slot is taken by a promotion in progress or a swap."""
        if key in self._lru:  # cannot happen (pool and tier are exclusive); keep the newer
            self.discard(key)
        slot, evicted = self._claim()
        if slot is None:
            return False, evicted
        self._store(slot, block_id)
        self._lru[key] = slot
        self.stats.demotions += 1
        return True, evicted

    def swap_out(self, key: SwapKey, block_id: int) -> tuple[bool, list[TierKey]]:
        """Copy pool block `block_id` in as `key`, held until `swap_in` or `drop_swapped`.
        Returns (kept, LRU entries evicted to make room)."""
        slot, evicted = self._claim()
        if slot is None:
            return False, evicted
        self._store(slot, block_id)
        self._swapped[key] = slot
        return True, evicted

    def has_swapped(self, key: SwapKey) -> bool:
        return key in self._swapped

    def swap_in(self, key: SwapKey, block_id: int) -> None:
        """Copy a swapped-out block back into pool block `block_id`, freeing its slot."""
        self._load(self._swapped.pop(key), block_id)

    def drop_swapped(self, key: SwapKey) -> None:
        slot = self._swapped.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def pin(self, keys: list[TierKey]) -> None:
        """Keep these entries (now or once demoted) from LRU eviction until `unpin`."""
        for key in keys:
            self._pinned[key] = self._pinned.get(key, 0) + 1

    def unpin(self, keys: list[TierKey]) -> None:
        for key in keys:
            n = self._pinned.pop(key, 0) - 1
            if n > 0:
                self._pinned[key] = n

    def _claim(self) -> tuple[int | None, list[TierKey]]:
        """A free slot, evicting the least recent unpinned LRU entry if none is (None: every
        slot is held by a promotion in progress, a swap or a pinned entry)."""
        evicted: list[TierKey] = []
        if not self._free:
            old = next((key for key in self._lru if key not in self._pinned), None)
            if old is None:
                return None, evicted
            self._free.append(self._lru.pop(old))
            self.stats.evictions += 1
            evicted.append(old)
        return self._free.pop(), evicted

    def take(self, key: TierKey) -> int:
        """Remove `key` for a promotion; its slot stays held until `load`."""
        return self._lru.pop(key)

    def load(self, slot: int, block_id: int) -> None:
        """Copy a taken slot into pool block `block_id`, freeing the slot."""
        self._load(slot, block_id)
        self.stats.promotions += 1

    # ---- copies ----------------------------------------------------------------------------
    @contextmanager
    def batch(self) -> Iterator[None]:
        """Queue the copies made inside; the outermost exit runs them (`flush`)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self.flush()

    def _store(self, slot: int, block_id: int) -> None:
        self._stores[slot] = block_id  # a slot freed and reclaimed in a batch: the latest wins
        if not self._depth:
            self.flush()

    def _load(self, slot: int, block_id: int) -> None:
        self._loads.append((slot, block_id))  # the slot is freed by the flush, not before
        if not self._depth:
            self.flush()

    def flush(self) -> None:
        """Run the queued copies: every store, then every load (module docstring)."""
        if self._stores:
            stores, self._stores = self._stores, {}
            self._timed("store_s", self.storage.store_many, list(stores), list(stores.values()))
        if self._loads:
            loads, self._loads = self._loads, []
            slots = [slot for slot, _ in loads]
            self._timed("load_s", self.storage.load_many, slots, [b for _, b in loads])
            self._free.extend(slots)

    def measure(self, block_id: int = 0, rounds: int = 2) -> None:
        """Time store + load round trips of pool block `block_id` through a free slot (its
        bytes come back unchanged), so `copy_times` are known before the first demotion."""
        self.flush()
        if not self._free:
            return
        slot = self._free[-1]
        for _ in range(rounds):
            self._timed("store_s", self.storage.store_many, [slot], [block_id])
            self._timed("load_s", self.storage.load_many, [slot], [block_id])

    def _timed(self, op: str, copy, slots: list[int], block_ids: list[int]) -> None:
        t = time.perf_counter()
        copy(slots, block_ids)
        self.copy_times.observe(op, time.perf_counter() - t, len(slots))

    def discard(self, key: TierKey) -> None:
        """Forget `key` (the pool now holds the same block)."""
        self._free.append(self._lru.pop(key))

    def clear(self) -> list[TierKey]:
        """Forget every LRU entry (swapped-out blocks stay: they belong to requests); the
        entries dropped."""
        self.flush()
        keys = list(self._lru)
        for key in keys:
            self.discard(key)
        return keys


def tier_slots(size_bytes: int, block_bytes: int) -> int:
    """Blocks a tier of `size_bytes` holds (whole blocks only)."""
    return size_bytes // block_bytes
