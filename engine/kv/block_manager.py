"""KV block manager: per-request block tables over the block pool (engine/kv/block_pool.py).

A request has one block table per KV group (engine/kv/kv_groups.py: the layers that attend
alike; one group of all layers for most models). Table index i of every group covers the
request's positions i * block_size .. (i + 1) * block_size - 1; all groups draw their blocks
from one BlockPool. Here: prefix matching, allocation and lazy growth, copy-on-write, forks,
trimming, sliding-window release and swap on preemption.

Invariants:
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
- A prefix hit may end in blocks held by the pool's second tier (TIER in PrefixMatch), which
  `allocate` promotes into fresh pool blocks.
- Swap on preemption (`swap_out`): a preempted request's full blocks go the usual way (cached,
  demoted when evicted; pinned against the tier's LRU meanwhile); each group's partial last
  block is copied to the tier under (group, request id) and `_swapped[rid]` records its
  computed tokens. A prefix match that covers exactly its full blocks again ends in that
  block (PrefixMatch.swapped), which `allocate` swaps into a fresh pool block; `allocate` and
  `free` drop an unused one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from engine.core.request import Request
from engine.kv.block_hash import BlockHash, extend_block_hashes
from engine.kv.block_pool import TIER, BlockPool
from engine.kv.kv_tier import KVTier, TierKey

RELEASED = -1
"""A table entry whose block slid out of its group's window and went back to the pool."""


class PrefixMatch(NamedTuple):
    block_ids: list[list[int]]
    """Per group: the cached blocks of the hit (RELEASED before a sliding group's window,
    TIER where the second tier holds it)."""
    num_tokens: int
    swapped: int = 0
    """Of num_tokens, those past the full blocks: the request's swapped-out partial block
    (`BlockManager.swap_out`), the next table entry of every group."""


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found cached


class BlockManager:
    """The block tables of requests, over one BlockPool (`pool`, built here): what concerns
    blocks rather than requests — free blocks, pins, KV events, peers — is asked of it."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
        group_windows: tuple[int | None, ...] = (None,),
        tier: KVTier | None = None,
    ) -> None:
        """`num_blocks`, `record_events`, `tier`: the pool's (BlockPool). `group_windows`:
        each KV group's sliding window (None: full attention; engine/kv/kv_groups.py); a group
        with a window gives back the blocks that slid out of it."""
        self.pool = BlockPool(num_blocks, len(group_windows), record_events, tier)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = group_windows
        self.stats = PrefixCacheStats()
        self._groups = range(len(group_windows))
        # Groups that release as requests advance (none for full-attention models: the
        # per-step check in append_slots is then free).
        self._sliding = [g for g in self._groups if group_windows[g] is not None]
        self._tables: dict[str, list[list[int]]] = {}
        self._num_hashed: dict[str, int] = {}  # per request: leading blocks already cached
        self._num_released: dict[str, list[int]] = {}  # per request and group: RELEASED entries
        self._swapped: dict[str, int] = {}  # swapped-out request -> its computed tokens then
        self._swap_pins: dict[str, list[TierKey]] = {}  # -> tier entries pinned
        self._copies: list[tuple[int, int]] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

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

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies that must run before the next forward (copy-on-write)."""
        copies, self._copies = self._copies, []
        return copies

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
            if not all(self.pool.holds(g, h) for g in full):
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
            ids.append([RELEASED] * first + [self.pool.lookup(g, h) for h in hashes[first:k]])
        return PrefixMatch(ids, k * self.block_size + swapped, swapped)

    def _window_cached(self, request: Request, g: int, hashes: list[BlockHash], k: int) -> bool:
        """Group g holds the blocks before position k * block_size that the request still
        needs there: those in the window of a query at it, and those it keeps."""
        first = self._skip(request, g, k * self.block_size)
        return all(self.pool.holds(g, h) for h in hashes[first:k])

    def _first_in_window(self, g: int, first_query: int) -> int:
        """Table index of group g's first block a query at `first_query` or later reads."""
        window = self.group_windows[g]
        if window is None:
            return 0
        return max(0, first_query - window + 1) // self.block_size

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        prefix: PrefixMatch,
        first_query: int | None = None,
        keep_from: list[int] | None = None,
    ) -> bool:
        """First allocation for `request`: take the prefix hit's blocks and enough new ones
        for `num_new_tokens` more, in every group. `first_query`: the first position this
        worker computes (default: right after the hit; a remote prompt's KV arrives, so its
        first query follows the prompt) — a sliding group neither takes nor allocates the
        blocks wholly before its window, except from `keep_from[g]` on. False (and no
        change) if the pool cannot hold it now."""
        rid, pool = request.request_id, self.pool
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
        revived = sum(
            1 for _, taken, _ in plan for b in taken if b == TIER or pool.blocks[b].ref_count == 0
        )
        if sum(new for _, _, new in plan) + revived > pool.num_free_blocks:
            return False
        # Every group's pool hits are taken before anything is popped (a pop may evict any
        # cached free block); `promote` takes the tier's out of it before it pops.
        for _, taken, _ in plan:
            pool.pin([b for b in taken if b != TIER])
        hashes = request.block_hashes
        promote = [
            (g, skip + i)
            for g, (skip, taken, _) in enumerate(plan)
            for i, b in enumerate(taken)
            if b == TIER
        ]
        tables = [[RELEASED] * skip + taken for skip, taken, _ in plan]
        for (g, i), block_id in zip(promote, pool.promote([(g, hashes[i]) for g, i in promote])):
            tables[g][i] = block_id
        if promote:
            pool.the_tier.stats.hit_tokens += (hit - min(i for _, i in promote)) * self.block_size
        for g, (_, _, new) in enumerate(plan):
            tables[g].extend(pool.pop_many(g, new, after=_last(tables[g])))
        if prefix.swapped:
            for g in self._groups:
                pool.the_tier.swap_in((g, rid), tables[g][hit])
            pool.the_tier.stats.swap_ins += 1
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
                self.pool.release([table[i]])
                table[i] = RELEASED
            released[g] = max(released[g], upto)

    def append_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Room for `num_new_tokens` more tokens of a request that already has blocks: grows
        every table lazily and copies a shared partial block before it is written (after
        releasing what slid out of the windows). False (and no change but the release) if
        the pool is out of blocks."""
        if self._sliding:
            self.release_slid_out(request)
        pool, tables = self.pool, self._tables[request.request_id]
        start = request.num_computed_tokens
        needed = max(0, self.blocks_for(start + num_new_tokens) - len(tables[0]))
        write_block = start // self.block_size
        cows = [
            g
            for g in self._groups
            if write_block < len(tables[g]) and pool.blocks[tables[g][write_block]].ref_count > 1
        ]
        if needed * self.num_groups + len(cows) > pool.num_free_blocks:
            return False
        for g in cows:
            old = tables[g][write_block]
            tables[g][write_block] = pool.pop_free(g)
            pool.release([old])  # still shared: stays in use
            self._copies.append((old, tables[g][write_block]))
        for g in self._groups:
            if needed:
                tables[g].extend(pool.pop_many(g, needed, after=_last(tables[g])))
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
                self.pool.release(list(reversed(surplus)))

    def fork(self, parent: Request, child: Request) -> None:
        """`child` shares every block of `parent` (copy-on-write on the first divergent write)."""
        tables = [list(table) for table in self._tables[parent.request_id]]
        for table in tables:
            self.pool.pin([block_id for block_id in table if block_id != RELEASED])
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
                request.block_hashes,
                request.token_ids[: num_full * self.block_size],
                self.block_size,
                request.hash_extras,
            )
        for g in self._groups:
            table = tables[g]
            for i in range(start, num_full):
                if table[i] == RELEASED:  # never held here (a remote prompt's early blocks)
                    continue
                self.pool.cache_block(g, request.block_hashes[i], table[i])
        self._num_hashed[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Give back the request's blocks (and drop what it has swapped out, if anything)."""
        tables = self._tables.pop(request.request_id, None) or []
        self._num_hashed.pop(request.request_id, None)
        released = self._num_released.pop(request.request_id, None) or [0] * len(tables)
        for g, table in enumerate(tables):
            # Leaves before roots on the free list.
            self.pool.release(list(reversed(table[released[g] :])))
        self._drop_swapped(request.request_id)

    # ---- swap on preemption --------------------------------------------------------------
    def swap_out(self, request: Request) -> bool:
        """Free a preempted request, first copying each group's partial last block (its
        computed tokens past the last full block) to the tier, so that it resumes from
        `num_computed_tokens` (match_prefix, allocate) if its full blocks are still cached
        (pool or tier) then; those are pinned in the tier until then. False (freed, nothing
        kept) without a tier, without a partial block, or when the tier has no slot left for
        one (every slot swapped, pinned or being promoted)."""
        rid, tier = request.request_id, self.pool.tier
        computed = request.num_computed_tokens
        full, partial = divmod(computed, self.block_size)
        tables = self._tables[rid]
        # Freed first: the partial blocks (no hash) wait on the free list, intact until popped,
        # and nothing is popped before they are copied out.
        self.free(request)
        kept = tier is not None and partial > 0
        if kept:
            for g in self._groups:
                kept = self.pool.swap_out((g, rid), tables[g][full])
                if not kept:
                    self._drop_swapped(rid)  # the groups already copied
                    break
        if kept:
            tier = self.pool.the_tier
            self._swapped[rid] = computed
            # The blocks it resumes after (every group's, a sliding one's window) stay put.
            pins = self._swap_pins[rid] = [
                (g, h)
                for g in self._groups
                for h in request.block_hashes[self._skip(request, g, full * self.block_size) : full]
            ]
            tier.pin(pins)
            tier.stats.swap_outs += 1
        return kept

    def _drop_swapped(self, rid: str) -> None:
        self._swapped.pop(rid, None)
        tier = self.pool.tier
        if tier is not None:
            for g in self._groups:
                tier.drop_swapped((g, rid))
            tier.unpin(self._swap_pins.pop(rid, []))

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (BlockPool.reset_prefix_cache) and every swapped-out
        partial block: all of it was computed by the weights being replaced."""
        self.pool.reset_prefix_cache()
        for rid in list(self._swapped):
            self._drop_swapped(rid)


def _last(table: list[int]) -> int | None:
    """The block a table ends with (None: empty, or its last entry slid out of a window)."""
    return table[-1] if table and table[-1] != RELEASED else None
