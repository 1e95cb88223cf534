"""KV block manager: free list, block tables, ref counts, copy-on-write, prefix cache.

A request has one block table per KV group (engine/kv_groups.py: the layers that attend
alike; one group of all layers for most models). Table index i of every group covers the
request's positions i * block_size .. (i + 1) * block_size - 1; all groups draw their blocks
from one free list.

Invariants:
- A block is in `_free` iff its ref count is 0. `_free` is the eviction order, front first:
  never-cached blocks go to the front (reused first), cached blocks to the back in reverse
  table order, so the least recently freed prefixes go first and leaves before their roots.
- `_cached[g][h] == b` implies `blocks[b].block_hash == h` and `blocks[b].group == g`; a
  cached block with ref count 0 is reusable (a prefix hit takes it back off the free list)
  until it is evicted for reuse.
- Only full blocks whose tokens are computed carry a hash; nothing ever writes into a block
  with a hash (writes go to positions >= num_computed_tokens, which are past every full one).
- Sliding windows: a group with window W serves queries at position p from keys
  p - W + 1 .. p, and no query of a request is ever again earlier than its
  num_computed_tokens. So that group's leading table entries of blocks wholly before
  num_computed_tokens - W + 1 are released as the request advances (or never taken: a prefix
  hit's early blocks, a remote prompt's early blocks) and read RELEASED. RELEASED entries are
  always a leading run of a table; nothing reads them (the attention backends never read
  blocks before a window). `Request.keep_blocks_from` pins a suffix of each table (a
  prefill worker streaming those blocks out).
- Second tier (`tier`, engine/kv_tier.py; None: off): a cached block evicted for reuse is
  demoted there (its bytes copied out before `_pop_free` returns it), and a prefix hit may end
  in blocks held there (TIER in PrefixMatch), which `allocate` promotes into fresh pool blocks.
  (g, h) is in `_cached[g]` or in the tier, never both; group 0's hashes in either are what
  this worker announces as held (KV events, `cached_hashes`).
- Swap on preemption (`swap_out`): a preempted request's full blocks go the usual way (cached,
  demoted when evicted; pinned against the tier's LRU meanwhile); each group's partial last
  block is copied to the tier under (group, request id) and `_swapped[rid]` records its
  computed tokens. A prefix match that covers exactly its full blocks again ends in that
  block (PrefixMatch.swapped), which `allocate` swaps into a fresh pool block; `allocate` and
  `free` drop an unused one.
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import ContextManager, NamedTuple

from engine.block_hash import BlockHash, extend_block_hashes
from engine.kv_tier import KVTier
from engine.request import Request

RELEASED = -1
"""A table entry whose block slid out of its group's window and went back to the pool."""
TIER = -2
"""A PrefixMatch entry whose block is held by the second tier (promoted by `allocate`)."""


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    group: int = 0  # the KV group whose table holds it (meaningful while hashed or in use)


class PrefixMatch(NamedTuple):
    block_ids: list[list[int]]
    """Per group: the cached blocks of the hit (RELEASED before a sliding group's window,
    TIER where the second tier holds it)."""
    num_tokens: int
    swapped: int = 0
    """Of num_tokens, those past the full blocks: the request's swapped-out partial block
    (`BlockManager.swap_out`), the next table entry of every group."""


class KVEvent(NamedTuple):
    stored: bool  # True: block hash now held here (pool or tier); False: held nowhere here
    block_hash: BlockHash
    tier: int = 0  # where a stored block now is: 0 the pool, 1 the offloading tier


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found cached


@dataclass(eq=False)
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    record_events: bool = False  # keep KVEvents for a subscriber (workers -> router index)
    group_windows: tuple[int | None, ...] = (None,)
    """Each KV group's sliding window (None: full attention; engine/kv_groups.py). A group
    with a window gives back the blocks that slid out of it."""
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    tier: KVTier | None = None
    """The second tier evicted cached blocks are demoted to (None: they are dropped)."""

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError("the KV pool has no blocks: raise the KV cache memory budget")
        self.blocks = [KVBlock(i) for i in range(self.num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self._groups = range(len(self.group_windows))
        # Groups that release as requests advance (none for full-attention models: the
        # per-step check in append_slots is then free).
        self._sliding = [g for g in self._groups if self.group_windows[g] is not None]
        self._cached: list[dict[BlockHash, int]] = [{} for _ in self._groups]
        self._tables: dict[str, list[list[int]]] = {}
        self._num_hashed: dict[str, int] = {}  # per request: leading blocks already cached
        self._num_released: dict[str, list[int]] = {}  # per request and group: RELEASED entries
        self._swapped: dict[str, int] = {}  # swapped-out request -> its computed tokens then
        self._swap_pins: dict[str, list[tuple[int, BlockHash]]] = {}  # -> tier entries pinned
        self._copies: list[tuple[int, int]] = []
        self._events: list[KVEvent] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Table entries (per group) that `num_tokens` positions take."""
        return -(-num_tokens // self.block_size)

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's table of every group."""
        return self._tables[request_id]

    def block_table(self, request_id: str) -> list[int]:
        """Group 0's table (the only one of a model whose layers all attend alike)."""
        return self._tables[request_id][0]

    def has_table(self, request_id: str) -> bool:
        return request_id in self._tables

    def cached_hashes(self) -> list[BlockHash]:
        """Hashes of group 0's blocks held in the pool or the tier (what KV events report)."""
        pool, tier = self.held_hashes()
        return pool + tier

    def held_hashes(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """`cached_hashes` by where they are: (in the pool, in the tier)."""
        tiered = [h for g, h in self.tier.keys() if g == 0] if self.tier is not None else []
        return list(self._cached[0]), tiered

    def _has(self, g: int, h: BlockHash) -> bool:
        """Group g holds block hash h in its prefix cache or the tier."""
        return h in self._cached[g] or (self.tier is not None and (g, h) in self.tier)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies that must run before the next forward (copy-on-write)."""
        copies, self._copies = self._copies, []
        return copies

    def copies_batched(self) -> ContextManager:
        """Inside, the tier's copies (demotions, promotions, swaps) are queued and run as one
        gathered store and one gathered load on exit (engine/kv_tier.py); without a tier,
        nothing. Whoever writes or reads the blocks allocated inside does so after exit."""
        return self.tier.batch() if self.tier is not None else nullcontext()

    # ---- allocation ----------------------------------------------------------------------
    def match_prefix(self, request: Request) -> PrefixMatch:
        """Longest run of cached full blocks at the start of the request that every group can
        serve: full-attention groups hold each of its blocks, sliding groups those the first
        query after it reads. At least the last token is always left to compute (its logits
        are needed). No hit for a request that needs every position (prompt logprobs, mean
        pooling): it computes its whole prompt (vLLM)."""
        empty = PrefixMatch([[] for _ in self._groups], 0)
        if not self.enable_prefix_caching or request.computes_whole_prompt:
            return empty
        swapped = self._swapped.get(request.request_id, 0)
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        full = [g for g in self._groups if self.group_windows[g] is None]
        k = len(hashes)
        for i, h in enumerate(hashes):
            if not all(self._has(g, h) for g in full):
                k = i
                break
        while k > 0 and not all(self._window_cached(request, g, hashes, k) for g in self._sliding):
            k -= 1
        # A swapped-out partial block resumes only right after the very blocks it followed.
        swapped = swapped - k * self.block_size if k == swapped // self.block_size else 0
        if k == 0 and not swapped:
            return empty
        ids = []
        for g in self._groups:
            first = self._skip(request, g, k * self.block_size)
            ids.append([RELEASED] * first + [self._cached[g].get(h, TIER) for h in hashes[first:k]])
            if self.tier is not None:
                for h in hashes[first:k]:
                    if (g, h) in self.tier:
                        self.tier.touch((g, h))
        return PrefixMatch(ids, k * self.block_size + swapped, swapped)

    def _window_cached(self, request: Request, g: int, hashes: list[BlockHash], k: int) -> bool:
        """Group g holds the blocks before position k * block_size that the request still
        needs there: those in the window of a query at it, and those it keeps."""
        first = self._skip(request, g, k * self.block_size)
        return all(self._has(g, h) for h in hashes[first:k])

    def _first_in_window(self, g: int, first_query: int) -> int:
        """Table index of group g's first block a query at `first_query` or later reads."""
        window = self.group_windows[g]
        if window is None:
            return 0
        return max(0, first_query - window + 1) // self.block_size

    def allocate(self, request: Request, num_new_tokens: int, prefix: PrefixMatch,
                 first_query: int | None = None, keep_from: list[int] | None = None) -> bool:
        """First allocation for `request`: take the prefix hit's blocks and enough new ones
        for `num_new_tokens` more, in every group. `first_query`: the first position this
        worker computes (default: right after the hit; a remote prompt's KV arrives, so its
        first query follows the prompt) — a sliding group neither takes nor allocates the
        blocks wholly before its window, except from `keep_from[g]` on. False (and no
        change) if the pool cannot hold it now."""
        rid = request.request_id
        assert rid not in self._tables, rid
        total = self.blocks_for(prefix.num_tokens + num_new_tokens)
        hit = prefix.num_tokens // self.block_size
        query = prefix.num_tokens if first_query is None else first_query
        plan = []  # per group: (skip, hit blocks to take, new blocks)
        for g in self._groups:
            skip = min(self._skip(request, g, query), total)
            if keep_from is not None:
                skip = min(skip, keep_from[g])
            taken = prefix.block_ids[g][skip:hit]  # never RELEASED: skip is past the hit's own
            plan.append((skip, taken, total - max(skip, hit)))
        revived = sum(1 for _, taken, _ in plan for b in taken
                      if b == TIER or self.blocks[b].ref_count == 0)
        if sum(new for _, _, new in plan) + revived > len(self._free):
            return False
        # Every group's pool hits are taken before anything is popped (a pop may evict any
        # cached free block), and the tier's are taken out of it (a pop may demote into it).
        for _, taken, _ in plan:
            for block_id in taken:
                if block_id != TIER:
                    self._take(block_id)
        hashes = request.block_hashes
        promote = [(g, skip + i, self.tier.take((g, hashes[skip + i])))
                   for g, (skip, taken, _) in enumerate(plan)
                   for i, b in enumerate(taken) if b == TIER]
        tables = [[RELEASED] * skip + taken for skip, taken, _ in plan]
        for g, i, slot in promote:
            tables[g][i] = self._promote(g, hashes[i], slot)
        if promote:
            self.tier.stats.hit_tokens += (hit - min(i for _, i, _ in promote)) * self.block_size
        for g, (_, _, new) in enumerate(plan):
            tables[g].extend(self._pop_free(g) for _ in range(new))
        if prefix.swapped:
            for g in self._groups:
                self.tier.swap_in((g, rid), tables[g][hit])
            self.tier.stats.swap_ins += 1
        self._drop_swapped(rid)  # resumed without it, or just loaded
        self._tables[rid] = request.block_tables = tables
        self._num_hashed[rid] = hit
        self._num_released[rid] = [skip for skip, _, _ in plan]
        self.stats.queries += request.num_tokens
        self.stats.hits += prefix.num_tokens - prefix.swapped
        return True

    def _skip(self, request: Request, g: int, first_query: int) -> int:
        """Group g's blocks before the window of a query at `first_query`, short of those
        the request keeps (Request.keep_blocks_from)."""
        first = self._first_in_window(g, first_query)
        keep = request.keep_blocks_from
        return first if keep is None else min(first, keep[g])

    def release_slid_out(self, request: Request) -> None:
        """Release each sliding group's blocks wholly before the window of the request's
        next query."""
        rid = request.request_id
        tables, released = self._tables[rid], self._num_released[rid]
        for g in self._sliding:
            upto = self._skip(request, g, request.num_computed_tokens)
            table = tables[g]
            for i in range(released[g], upto):
                self.release([table[i]])
                table[i] = RELEASED
            released[g] = max(released[g], upto)

    def append_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Room for `num_new_tokens` more tokens of a request that already has blocks: grows
        every table lazily and copies a shared partial block before it is written (after
        releasing what slid out of the windows). False (and no change but the release) if
        the pool is out of blocks."""
        if self._sliding:
            self.release_slid_out(request)
        tables = self._tables[request.request_id]
        start = request.num_computed_tokens
        needed = max(0, self.blocks_for(start + num_new_tokens) - len(tables[0]))
        write_block = start // self.block_size
        cows = [g for g in self._groups
                if write_block < len(tables[g]) and self.blocks[tables[g][write_block]].ref_count > 1]
        if needed * self.num_groups + len(cows) > len(self._free):
            return False
        for g in cows:
            old = tables[g][write_block]
            tables[g][write_block] = self._pop_free(g)
            self.blocks[old].ref_count -= 1  # still shared: > 0
            self._copies.append((old, tables[g][write_block]))
        for g in self._groups:
            tables[g].extend(self._pop_free(g) for _ in range(needed))
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Return the blocks past the first `num_tokens` positions of a request's tables
        (slots of rejected draft tokens). Those blocks were never computed into, so they
        carry no hash and go to the front of the free list."""
        keep = self.blocks_for(num_tokens)
        for table in self._tables[request.request_id]:
            if len(table) > keep:
                surplus = table[keep:]
                del table[keep:]
                self.release(list(reversed(surplus)))

    def fork(self, parent: Request, child: Request) -> None:
        """`child` shares every block of `parent` (copy-on-write on the first divergent write)."""
        tables = [list(table) for table in self._tables[parent.request_id]]
        for table in tables:
            for block_id in table:
                if block_id != RELEASED:
                    self.blocks[block_id].ref_count += 1
        self._tables[child.request_id] = child.block_tables = tables
        self._num_hashed[child.request_id] = self._num_hashed[parent.request_id]
        self._num_released[child.request_id] = list(self._num_released[parent.request_id])

    def cache_full_blocks(self, request: Request) -> None:
        """Give hashes to the request's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        tables = self._tables[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(tables[0]))
        start = self._num_hashed[request.request_id]
        if num_full <= start:
            return
        if len(request.block_hashes) < num_full:
            extend_block_hashes(
                request.block_hashes, request.token_ids[: num_full * self.block_size],
                self.block_size, request.hash_extras,
            )
        for g in self._groups:
            cached, table = self._cached[g], tables[g]
            for i in range(start, num_full):
                if table[i] == RELEASED:  # never held here (a remote prompt's early blocks)
                    continue
                h, block = request.block_hashes[i], self.blocks[table[i]]
                if block.block_hash is None and h not in cached:
                    if self.tier is not None and (g, h) in self.tier:
                        self.tier.discard((g, h))  # computed again: the pool's copy serves
                    self._cache(g, h, block.block_id)
        self._num_hashed[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Give back the request's blocks (and drop what it has swapped out, if anything)."""
        tables = self._tables.pop(request.request_id, None) or []
        self._num_hashed.pop(request.request_id, None)
        released = self._num_released.pop(request.request_id, None)
        for g, table in enumerate(tables):
            # Leaves before roots on the free list.
            self.release(list(reversed(table[released[g]:])))
        self._drop_swapped(request.request_id)

    def swap_out(self, request: Request) -> bool:
        """Free a preempted request, first copying each group's partial last block (its
        computed tokens past the last full block) to the tier, so that it resumes from
        `num_computed_tokens` (match_prefix, allocate) if its full blocks are still cached
        (pool or tier) then; those are pinned in the tier until then. False (freed, nothing
        kept) without a tier, without a partial block, or when the tier has no slot left for
        one (every slot swapped, pinned or being promoted)."""
        rid = request.request_id
        computed = request.num_computed_tokens
        full, partial = divmod(computed, self.block_size)
        tables = self._tables[rid]
        # Freed first: the partial blocks (no hash) wait on the free list, intact until popped,
        # and nothing is popped before they are copied out.
        self.free(request)
        kept = self.tier is not None and partial > 0
        if kept:
            for g in self._groups:
                kept, dropped = self.tier.swap_out((g, rid), tables[g][full])
                if self.record_events:  # LRU entries dropped to make room: held nowhere now
                    self._events.extend(KVEvent(False, h) for group, h in dropped if group == 0)
                if not kept:
                    self._drop_swapped(rid)  # the groups already copied
                    break
        if kept:
            self._swapped[rid] = computed
            # The blocks it resumes after (every group's, a sliding one's window) stay put.
            pins = self._swap_pins[rid] = [
                (g, h) for g in self._groups
                for h in request.block_hashes[self._skip(request, g, full * self.block_size):full]]
            self.tier.pin(pins)
            self.tier.stats.swap_outs += 1
        return kept

    def _drop_swapped(self, rid: str) -> None:
        self._swapped.pop(rid, None)
        if self.tier is not None:
            for g in self._groups:
                self.tier.drop_swapped((g, rid))
            self.tier.unpin(self._swap_pins.pop(rid, []))

    def pin(self, block_ids: list[int]) -> None:
        """Hold blocks beyond their requests (e.g. while a KV transfer reads them). Valid for
        blocks of a request freed earlier in this engine step: nothing was allocated since,
        so their contents are intact; pinning takes them back off the free list."""
        for block_id in block_ids:
            self._take(block_id)

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference per block (the inverse of `pin`; `free` uses it for a table)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents, not their identity)."""
        for g, cached in enumerate(self._cached):
            for h, block_id in cached.items():
                self.blocks[block_id].block_hash = None
                if self.record_events and g == 0:
                    self._events.append(KVEvent(False, h))
            cached.clear()
        if self.tier is not None:
            for g, h in self.tier.clear():
                if self.record_events and g == 0:
                    self._events.append(KVEvent(False, h))
            for rid in list(self._swapped):  # computed by the weights being replaced
                self._drop_swapped(rid)

    # ---- internals -----------------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _pop_free(self, group: int = 0) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: the cached contents are about to change
            self._evict(block)
        block.ref_count = 1
        block.group = group
        return block_id

    def _cache(self, g: int, h: BlockHash, block_id: int) -> None:
        """Block `block_id` holds group g's KV of hash h: it joins the prefix cache (the
        caller made sure neither the pool nor the tier holds h)."""
        self.blocks[block_id].block_hash = h
        self._cached[g][h] = block_id
        if self.record_events and g == 0:
            self._events.append(KVEvent(True, h))

    def _promote(self, g: int, h: BlockHash, slot: int) -> int:
        """Copy a tier slot taken for (g, h) into a fresh pool block, cached under h."""
        block_id = self._pop_free(g)
        self.tier.load(slot, block_id)
        self._cache(g, h, block_id)
        return block_id

    def _evict(self, block: KVBlock) -> None:
        """Drop a cached free block's hash; with a tier, its bytes are demoted there first."""
        g, h = block.group, block.block_hash
        del self._cached[g][h]
        block.block_hash = None
        kept, dropped = (False, []) if self.tier is None else self.tier.demote((g, h), block.block_id)
        if self.record_events:
            if g == 0:
                self._events.append(KVEvent(True, h, tier=1) if kept else KVEvent(False, h))
            self._events.extend(KVEvent(False, old) for group, old in dropped if group == 0)

    # ---- KV exchanged with peer workers (worker_runtime/kv_pull.py, kv_export.py) ---------
    def hold_cached(self, hashes: list[BlockHash]) -> list[int] | None:
        """Pin the pool blocks that hold `hashes` (a peer reads them), promoting those the
        tier holds into fresh pool blocks; `release` lets them go. None, with nothing
        pinned, if one is held nowhere here or the pool has no room for the promotions."""
        self._check_one_group()
        cached = self._cached[0]
        if not all(self._has(0, h) for h in hashes):
            return None
        in_pool = [cached[h] for h in hashes if h in cached]
        in_tier = [h for h in hashes if h not in cached]
        if len(in_tier) > len(self._free) - sum(self.blocks[b].ref_count == 0 for b in in_pool):
            return None
        self.pin(in_pool)  # before any pop: a pop may evict any cached free block
        slots = {h: self.tier.take((0, h)) for h in in_tier}  # before any demotion
        return [cached[h] if h in cached else self._promote(0, h, slots[h]) for h in hashes]

    def reserve(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` fresh blocks held outside any table (a peer writes into them), or
        None if the pool has not that many free now. `adopt` or `release` them."""
        self._check_one_group()
        if num_blocks > len(self._free):
            return None
        return [self._pop_free(0) for _ in range(num_blocks)]

    def adopt(self, hashes: list[BlockHash], block_ids: list[int]) -> int:
        """Blocks from `reserve` now hold the KV of `hashes` (a prefix chain, in order): they
        join the prefix cache as reusable free blocks (leaves evicted before roots), except
        where the pool or tier already holds that hash (the spare block is just freed).
        Returns how many joined."""
        joined = 0
        for h, block_id in zip(hashes, block_ids, strict=True):
            if not self._has(0, h):
                self._cache(0, h, block_id)
                joined += 1
        self.release(list(reversed(block_ids)))
        return joined

    def _check_one_group(self) -> None:
        if self.num_groups != 1:
            raise ValueError("KV is exchanged with peers only for models whose layers all "
                             f"attend alike (this one has {self.num_groups} KV groups)")
