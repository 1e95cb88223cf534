"""KV block manager: free list, block tables, ref counts, copy-on-write, prefix cache.

Invariants:
- A block is in `_free` iff its ref count is 0. `_free` is the eviction order, front first:
  never-cached blocks go to the front (reused first), cached blocks to the back in reverse
  table order, so the least recently freed prefixes go first and leaves before their roots.
- `_cached[h] == b` implies `blocks[b].block_hash == h`; a cached block with ref count 0 is
  reusable (a prefix hit takes it back off the free list) until it is evicted for reuse.
- Only full blocks whose tokens are computed carry a hash; nothing ever writes into a block
  with a hash (writes go to positions >= num_computed_tokens, which are past every full one).
- Sliding window (`sliding_window` W set: every layer of the model attends to at most W
  keys): a query at position p reads keys p - W + 1 .. p, and no query of a request is ever
  again earlier than its num_computed_tokens. So the leading table entries of blocks wholly
  before num_computed_tokens - W + 1 are released as the request advances (or never taken:
  a prefix hit's early blocks, a remote prompt's early blocks) and read RELEASED. RELEASED
  entries are always a leading run of the table; nothing reads them (the attention backends
  never read blocks before a window). A request may pin a suffix of its table
  (`Request.keep_blocks_from`: a prefill worker streaming those blocks out).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.block_hash import BlockHash, extend_block_hashes
from engine.request import Request


RELEASED = -1
"""A table entry whose block slid out of every window and went back to the pool."""


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class PrefixMatch(NamedTuple):
    block_ids: list[int]
    num_tokens: int


class KVEvent(NamedTuple):
    stored: bool  # True: block hash now cached here; False: evicted
    block_hash: BlockHash


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
    sliding_window: int | None = None
    """W when every layer attends to at most W keys: blocks that slid out are released."""
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError("the KV pool has no blocks: raise the KV cache memory budget")
        self.blocks = [KVBlock(i) for i in range(self.num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}  # per request: leading blocks already cached
        self._num_released: dict[str, int] = {}  # per request: leading RELEASED entries
        self._copies: list[tuple[int, int]] = []
        self._events: list[KVEvent] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def has_table(self, request_id: str) -> bool:
        return request_id in self._tables

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies that must run before the next forward (copy-on-write)."""
        copies, self._copies = self._copies, []
        return copies

    # ---- allocation ----------------------------------------------------------------------
    def match_prefix(self, request: Request) -> PrefixMatch:
        """Longest run of cached full blocks at the start of the request. At least the last
        token is always left to compute (its logits are needed). No hit for a request that
        needs every position (prompt logprobs, mean pooling): it computes its whole prompt
        (vLLM)."""
        if not self.enable_prefix_caching or request.computes_whole_prompt:
            return PrefixMatch([], 0)
        max_blocks = (request.num_tokens - 1) // self.block_size
        ids: list[int] = []
        for h in request.block_hashes[:max_blocks]:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            ids.append(block_id)
        return PrefixMatch(ids, len(ids) * self.block_size)

    def allocate(self, request: Request, num_new_tokens: int, prefix: PrefixMatch,
                 first_query: int | None = None) -> bool:
        """First allocation for `request`: take the prefix hit's blocks and enough new ones
        for `num_new_tokens` more. `first_query`: the first position this worker computes
        (default: right after the hit; a remote prompt's KV arrives, so its first query
        follows the prompt) — with a sliding window the blocks wholly before its window are
        neither taken nor allocated. False (and no change) if the pool cannot hold it now."""
        assert request.request_id not in self._tables, request.request_id
        total = self.blocks_for(prefix.num_tokens + num_new_tokens)
        skip = self._first_needed(request, prefix.num_tokens if first_query is None else first_query)
        skip = min(skip, total)
        hits = prefix.block_ids[skip:]
        needed = total - max(skip, len(prefix.block_ids))
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if needed + revived > len(self._free):
            return False
        for block_id in hits:
            self._take(block_id)
        table = [RELEASED] * skip + hits + [self._pop_free() for _ in range(needed)]
        self._tables[request.request_id] = request.block_table = table
        self._num_hashed[request.request_id] = len(prefix.block_ids)
        self._num_released[request.request_id] = skip
        self.stats.queries += request.num_tokens
        self.stats.hits += prefix.num_tokens
        return True

    def num_released(self, request: Request) -> int:
        """Leading table entries of `request` that are RELEASED."""
        return self._num_released[request.request_id]

    def _first_needed(self, request: Request, first_query: int) -> int:
        """Table index of the first block a query at `first_query` or later can read."""
        if self.sliding_window is None:
            return 0
        first = max(0, first_query - self.sliding_window + 1) // self.block_size
        keep = request.keep_blocks_from
        return first if keep is None else min(first, keep)

    def release_slid_out(self, request: Request) -> None:
        """Release the blocks wholly before the window of the request's next query."""
        rid = request.request_id
        table, done = self._tables[rid], self._num_released[rid]
        upto = self._first_needed(request, request.num_computed_tokens)
        if upto <= done:
            return
        for i in range(done, upto):
            self.release([table[i]])
            table[i] = RELEASED
        self._num_released[rid] = upto

    def append_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Room for `num_new_tokens` more tokens of a request that already has blocks: grows
        the table lazily and copies a shared partial block before it is written. False (and
        no change) if the pool is out of blocks."""
        if self.sliding_window is not None:
            self.release_slid_out(request)
        table = self._tables[request.request_id]
        start = request.num_computed_tokens
        needed = max(0, self.blocks_for(start + num_new_tokens) - len(table))
        write_block = start // self.block_size
        cow = write_block < len(table) and self.blocks[table[write_block]].ref_count > 1
        if needed + cow > len(self._free):
            return False
        if cow:
            old = table[write_block]
            table[write_block] = self._pop_free()
            self.blocks[old].ref_count -= 1  # still shared: > 0
            self._copies.append((old, table[write_block]))
        table.extend(self._pop_free() for _ in range(needed))
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Return the blocks past the first `num_tokens` positions of a request's table
        (slots of rejected draft tokens). Those blocks were never computed into, so they
        carry no hash and go to the front of the free list."""
        table = self._tables[request.request_id]
        keep = self.blocks_for(num_tokens)
        if len(table) > keep:
            surplus = table[keep:]
            del table[keep:]
            self.release(list(reversed(surplus)))

    def fork(self, parent: Request, child: Request) -> None:
        """`child` shares every block of `parent` (copy-on-write on the first divergent write)."""
        table = list(self._tables[parent.request_id])
        for block_id in table:
            if block_id != RELEASED:
                self.blocks[block_id].ref_count += 1
        self._tables[child.request_id] = child.block_table = table
        self._num_hashed[child.request_id] = self._num_hashed[parent.request_id]
        self._num_released[child.request_id] = self._num_released[parent.request_id]

    def cache_full_blocks(self, request: Request) -> None:
        """Give hashes to the request's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_hashed[request.request_id]
        if num_full <= start:
            return
        if len(request.block_hashes) < num_full:
            extend_block_hashes(
                request.block_hashes, request.token_ids[: num_full * self.block_size],
                self.block_size, request.hash_extras,
            )
        for i in range(start, num_full):
            if table[i] == RELEASED:  # never held here (a remote prompt's early blocks)
                continue
            h, block = request.block_hashes[i], self.blocks[table[i]]
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                self._cached[h] = block.block_id
                if self.record_events:
                    self._events.append(KVEvent(True, h))
        self._num_hashed[request.request_id] = num_full

    def free(self, request: Request) -> None:
        table = self._tables.pop(request.request_id, None) or []
        self._num_hashed.pop(request.request_id, None)
        released = self._num_released.pop(request.request_id, 0)
        self.release(list(reversed(table[released:])))  # leaves before roots on the free list

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
        for h, block_id in self._cached.items():
            self.blocks[block_id].block_hash = None
            if self.record_events:
                self._events.append(KVEvent(False, h))
        self._cached.clear()

    # ---- internals -----------------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: the cached contents are about to change
            del self._cached[block.block_hash]
            if self.record_events:
                self._events.append(KVEvent(False, block.block_hash))
            block.block_hash = None
        block.ref_count = 1
        return block_id
