"""KV block pool: the blocks, their ref counts, the free list, the prefix cache, KV events.

The pool knows blocks, not requests: requests' block tables are a layer above
(engine/kv/block_manager.py); KV transfers pin blocks beyond their requests (`pin`, `release`);
peer workers read and write cached blocks by hash (`hold_cached`, `reserve`, `adopt`). Blocks
are cached per KV group (engine/kv/kv_groups.py) under their chained block hash.

Invariants:
- A block is in `_free` iff its ref count is 0. `_free` is the eviction order, front first:
  never-cached blocks go to the front (reused first), cached blocks to the back in the order
  they are released (a table is released in reverse), so the least recently freed prefixes
  go first and leaves before their roots.
- `_cached[g][h] == b` implies `blocks[b].block_hash == h` and `blocks[b].group == g`; a
  cached block with ref count 0 is reusable (`pin` takes it back off the free list) until
  `pop_free` evicts it for reuse.
- Runs: `pop_many` hands out n blocks as runs of adjacent ids where the free list allows
  (a KV transfer moves a run as one region). It takes exactly the blocks n `pop_free`s
  would evict, or never-cached ones instead of never-cached ones (all alike: no contents
  worth keeping), and returns them sorted; O(n) dict operations plus a sort of n.
- Second tier (`tier`, engine/kv/kv_tier.py; None: off): a cached block evicted for reuse is
  demoted there (its bytes copied out before `pop_free` returns it), and `promote` copies one
  back into a fresh pool block. (g, h) is in `_cached[g]` or in the tier, never both; group
  0's hashes in either are what this worker announces as held (KV events, `cached_hashes`).
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager, NamedTuple

from engine.kv.block_hash import BlockHash
from engine.kv.kv_tier import KVTier, SwapKey, TierKey

TIER = -2
"""In place of a pool block id: the block is held by the second tier (`BlockPool.lookup`)."""


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    group: int = 0  # the KV group whose table holds it (meaningful while hashed or in use)


class KVEvent(NamedTuple):
    stored: bool  # True: block hash now held here (pool or tier); False: held nowhere here
    block_hash: BlockHash
    tier: int = 0  # where a stored block now is: 0 the pool, 1 the offloading tier


@dataclass(eq=False)
class BlockPool:
    num_blocks: int
    num_groups: int = 1
    """KV groups (engine/kv/kv_groups.py): each caches its blocks under its own hashes."""
    record_events: bool = False  # keep KVEvents for a subscriber (workers -> router index)
    tier: KVTier | None = None
    """The second tier evicted cached blocks are demoted to (None: they are dropped)."""

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError("the KV pool has no blocks: raise the KV cache memory budget")
        self.blocks = [KVBlock(i) for i in range(self.num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached: list[dict[BlockHash, int]] = [{} for _ in range(self.num_groups)]
        self._events: list[KVEvent] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def holds(self, g: int, h: BlockHash) -> bool:
        """Group g holds block hash h in its prefix cache or the tier."""
        return h in self._cached[g] or (self.tier is not None and (g, h) in self.tier)

    def lookup(self, g: int, h: BlockHash) -> int:
        """The block caching group g's hash h, which this pool `holds`: a pool block id, or
        TIER where the tier holds it (a use: it becomes the tier's most recent entry)."""
        block_id = self._cached[g].get(h, TIER)
        if block_id == TIER:
            self.the_tier.touch((g, h))
        return block_id

    def cached_hashes(self) -> list[BlockHash]:
        """Hashes of group 0's blocks held in the pool or the tier (what KV events report)."""
        pool, tier = self.held_hashes()
        return pool + tier

    def held_hashes(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """`cached_hashes` by where they are: (in the pool, in the tier)."""
        tiered = [h for g, h in self.tier.keys() if g == 0] if self.tier is not None else []
        return list(self._cached[0]), tiered

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def copies_batched(self) -> ContextManager:
        """Inside, the tier's copies (demotions, promotions, swaps) are queued and run as one
        gathered store and one gathered load on exit (engine/kv/kv_tier.py); without a tier,
        nothing. Whoever writes or reads the blocks allocated inside does so after exit."""
        return self.tier.batch() if self.tier is not None else nullcontext()

    # ---- references ----------------------------------------------------------------------
    def pop_free(self, group: int) -> int:
        """The block at the front of the free list, now in use by one reference for `group`;
        a cached one is evicted first (demoted to the tier, if any). The caller made sure
        the list is not empty."""
        block_id, _ = self._free.popitem(last=False)
        self._take(block_id, group)
        return block_id

    def pop_many(self, group: int, n: int, after: int | None = None) -> list[int]:
        """n blocks off the free list, as `pop_free` n times would take them, but in runs of
        adjacent ids where the free list allows (invariants above), sorted. `after`: the
        block the caller's table ends with; its successor comes first if never cached (a
        table that grows stays one run). The caller made sure the list holds n."""
        free, out = self._free, list[int]()
        if after is not None and n and self._spare(after + 1):
            self._extend(after + 1, group, n, out)
        while len(out) < n:
            block_id, _ = free.popitem(last=False)
            spare = self.blocks[block_id].block_hash is None
            self._take(block_id, group)
            out.append(block_id)
            if spare:  # never-cached successors are as good as the next never-cached block
                self._extend(block_id + 1, group, n, out)
        out.sort()
        return out

    def _spare(self, block_id: int) -> bool:
        """Block `block_id` exists, is free and was never cached (or forgot its hash)."""
        if not 0 <= block_id < self.num_blocks:
            return False
        block = self.blocks[block_id]
        return block.ref_count == 0 and block.block_hash is None

    def _extend(self, block_id: int, group: int, n: int, out: list[int]) -> None:
        """Take blocks block_id, block_id + 1, ... into `out` while they are spare and `out`
        holds fewer than n."""
        while len(out) < n and self._spare(block_id):
            del self._free[block_id]
            self._take(block_id, group)
            out.append(block_id)
            block_id += 1

    def _take(self, block_id: int, group: int) -> None:
        """A block just taken off the free list is in use by one reference for `group`; a
        cached one is evicted first (demoted to the tier, if any)."""
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: the cached contents are about to change
            self._evict(block)
        block.ref_count = 1
        block.group = group

    def pin(self, block_ids: list[int]) -> None:
        """One more reference to each block. A free one comes back off the free list with its
        contents: intact if it is cached (a prefix hit) or was freed earlier in this engine
        step (nothing was popped since: a KV transfer may hold it beyond its request)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference per block (the inverse of `pin` and `pop_free`); those left with
        none join the free list in this order (see the invariants above)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    # ---- prefix cache and tier -----------------------------------------------------------
    def cache_block(self, g: int, h: BlockHash, block_id: int) -> None:
        """Block `block_id` (full, computed) holds group g's KV of hash h: it joins the prefix
        cache, unless it has a hash already or another pool block caches h; the tier's copy
        of h, if any, goes (the pool's serves)."""
        if self.blocks[block_id].block_hash is None and h not in self._cached[g]:
            if self.tier is not None and (g, h) in self.tier:
                self.tier.discard((g, h))
            self._cache(g, h, block_id)

    @property
    def the_tier(self) -> KVTier:
        """The tier, where the caller knows there is one (a TIER lookup, a swap, a
        promotion)."""
        assert self.tier is not None
        return self.tier

    def promote(self, keys: list[TierKey]) -> list[int]:
        """Copy the tier's blocks of `keys` (group, hash) into fresh pool blocks, cached under
        their hashes, in order. The caller made sure the free list holds that many."""
        if not keys:
            return []
        tier = self.the_tier
        slots = [tier.take(key) for key in keys]  # before any pop: a pop may demote
        by_group: dict[int, list[int]] = {}  # group -> indices into keys
        for i, (g, _) in enumerate(keys):
            by_group.setdefault(g, []).append(i)
        block_ids = [0] * len(keys)
        for g, indices in by_group.items():
            for i, block_id in zip(indices, self.pop_many(g, len(indices))):
                block_ids[i] = block_id
        for (g, h), slot, block_id in zip(keys, slots, block_ids):
            tier.load(slot, block_id)
            self._cache(g, h, block_id)
        return block_ids

    def swap_out(self, key: SwapKey, block_id: int) -> bool:
        """Copy block `block_id` into the tier under `key` (KVTier.swap_out); False if the
        tier has no slot left for it."""
        kept, dropped = self.the_tier.swap_out(key, block_id)
        self._dropped(dropped)
        return kept

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash, the tier's included (blocks in use keep their contents,
        not their identity)."""
        for g, cached in enumerate(self._cached):
            for h, block_id in cached.items():
                self.blocks[block_id].block_hash = None
                if self.record_events and g == 0:
                    self._events.append(KVEvent(False, h))
            cached.clear()
        if self.tier is not None:
            self._dropped(self.tier.clear())

    def _cache(self, g: int, h: BlockHash, block_id: int) -> None:
        """Block `block_id` holds group g's KV of hash h: it joins the prefix cache (the
        caller made sure neither the pool nor the tier holds h)."""
        self.blocks[block_id].block_hash = h
        self._cached[g][h] = block_id
        if self.record_events and g == 0:
            self._events.append(KVEvent(True, h))

    def _evict(self, block: KVBlock) -> None:
        """Drop a cached free block's hash; with a tier, its bytes are demoted there first."""
        g, h = block.group, block.block_hash
        assert h is not None  # only cached blocks are evicted
        del self._cached[g][h]
        block.block_hash = None
        kept, dropped = (
            (False, []) if self.tier is None else self.tier.demote((g, h), block.block_id)
        )
        if self.record_events and g == 0:
            self._events.append(KVEvent(True, h, tier=1) if kept else KVEvent(False, h))
        self._dropped(dropped)

    def _dropped(self, keys: list[TierKey]) -> None:
        """The tier dropped these entries: held nowhere here now."""
        if self.record_events:
            self._events.extend(KVEvent(False, h) for g, h in keys if g == 0)

    # ---- KV exchanged with peer workers (worker_runtime/kv_pull.py, kv_export.py) ---------
    def hold_cached(self, hashes: list[BlockHash]) -> list[int] | None:
        """Pin the pool blocks that hold `hashes` (a peer reads them), promoting those the
        tier holds into fresh pool blocks; `release` lets them go. None, with nothing
        pinned, if one is held nowhere here or the pool has no room for the promotions."""
        self._check_one_group()
        cached = self._cached[0]
        if not all(self.holds(0, h) for h in hashes):
            return None
        in_pool = [cached[h] for h in hashes if h in cached]
        in_tier = [(0, h) for h in hashes if h not in cached]
        if len(in_tier) > len(self._free) - sum(self.blocks[b].ref_count == 0 for b in in_pool):
            return None
        self.pin(in_pool)  # before any pop: a pop may evict any cached free block
        self.promote(in_tier)
        return [cached[h] for h in hashes]

    def reserve(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` fresh blocks held outside any table (a peer writes into them), or
        None if the pool has not that many free now. `adopt` or `release` them."""
        self._check_one_group()
        if num_blocks > len(self._free):
            return None
        return self.pop_many(0, num_blocks)

    def adopt(self, hashes: list[BlockHash], block_ids: list[int]) -> int:
        """Blocks from `reserve` now hold the KV of `hashes` (a prefix chain, in order): they
        join the prefix cache as reusable free blocks (leaves evicted before roots), except
        where the pool or tier already holds that hash (the spare block is just freed).
        Returns how many joined."""
        joined = 0
        for h, block_id in zip(hashes, block_ids, strict=True):
            if not self.holds(0, h):
                self._cache(0, h, block_id)
                joined += 1
        self.release(list(reversed(block_ids)))
        return joined

    def _check_one_group(self) -> None:
        if self.num_groups != 1:
            raise ValueError(
                "KV is exchanged with peers only for models whose layers all "
                f"attend alike (this one has {self.num_groups} KV groups)"
            )
