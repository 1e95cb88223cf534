"""Which workers hold which KV blocks, and where: block hash -> the workers holding it, and
those of them holding it in their second KV tier (docs/kv_offloading.md), kept from the
workers' KV-event streams (stored with a tier / removed) and rebuilt from their cached-block
snapshots. A block a worker demotes to its tier or promotes back is stored again with its new
tier; it is removed when the worker holds it in neither.

Hashes come from `engine.kv.block_hash.compute_block_hashes` — the engine's own function — so a
prompt's hashes here equal the hashes a worker's prefix cache stores, by construction.

Holders of a block are a bit set (an int, one bit per worker slot): matching a prompt against
every worker is one dict lookup and one AND per block, whatever the number of workers (plus
one more AND, and a count per holder, for the blocks someone holds in a tier).

Bounded: a worker's entries are at most what its registration says it can hold
(`set_limit`: its pool's blocks and its second tier's, from its published capacity); stores
beyond that are dropped and counted (`dropped`), so a worker that sends events without end
cannot grow the index without end.
"""

from __future__ import annotations

from itertools import chain, repeat
from typing import Iterable, NamedTuple, Sequence

from engine.kv.block_hash import BlockHash, compute_block_hashes


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    lora_id: int | None = None,
    kv_cache_dtype: str = "auto",
    weights_version: int = 0,
) -> list[BlockHash]:
    """Hashes of the prompt blocks a worker can reuse: full blocks, leaving at least the last
    token to compute (the engine's prefix matching never reuses further). `lora_id`: the
    request's adapter (engine.lora_id_for(name)); it enters every hash, as in the engine.
    `kv_cache_dtype`: the worker's KV format (WorkerInfo.kv_cache_dtype, normalized); a
    quantized one enters every hash too, so workers of one format share hashes.
    `weights_version`: the worker's (WorkerInfo.weights_version), also in every hash."""
    usable = (len(token_ids) - 1) // block_size * block_size if token_ids else 0
    return compute_block_hashes(
        token_ids[:usable], block_size, cache_salt or None, lora_id, kv_cache_dtype, weights_version
    )


class PrefixHit(NamedTuple):
    """A worker's part of a prompt: its leading blocks held, and how many of those sit in its
    second tier (promoted into its pool before they are used; the rest are in the pool)."""

    blocks: int
    tier_blocks: int = 0


class KVIndex:
    """Block hash -> workers (and their tier). Not thread-safe; one event loop owns it."""

    def __init__(self) -> None:
        self._holders: dict[BlockHash, int] = {}  # hash -> bit set of worker slots
        self._tiered: dict[BlockHash, int] = {}  # hash -> the holders' slots where it is in a tier
        self._slot: dict[str, int] = {}  # worker id -> slot
        self._owner: list[str | None] = []  # slot -> worker id
        self._blocks: dict[str, dict[BlockHash, int]] = {}  # worker id -> its hashes -> tier
        self._limits: dict[str, tuple[int, int]] = {}  # worker id -> most (pool, tier) blocks
        self._counts: dict[str, list[int]] = {}  # worker id -> [pool, tier] blocks indexed
        self.dropped: dict[str, int] = {}
        """Worker id -> stores dropped because its share was full (since it was limited)."""

    def set_limit(self, worker_id: str, pool_blocks: int | None, tier_blocks: int = 0) -> None:
        """At most `pool_blocks` of the worker's entries in its pool and `tier_blocks` in
        its second tier (None: no limit, and its drop count is forgotten). Kept across
        `remove_worker`/`reset`; entries already held beyond a lowered limit stay until
        removed."""
        if pool_blocks is None:
            self._limits.pop(worker_id, None)
            self.dropped.pop(worker_id, None)
        else:
            self._limits[worker_id] = (pool_blocks, tier_blocks)

    def __len__(self) -> int:
        """Distinct block hashes indexed."""
        return len(self._holders)

    def workers(self) -> list[str]:
        return list(self._slot)

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def blocks_of(self, worker_id: str) -> dict[BlockHash, int]:
        """A copy of what the index holds of one worker: block hash -> tier."""
        return dict(self._blocks.get(worker_id, {}))

    def stored(
        self, worker_id: str, hashes: Iterable[BlockHash], tiers: Sequence[int] = ()
    ) -> None:
        """The worker now holds `hashes`; `tiers[i]`: where hashes[i] is (0 the pool, else
        the second tier; missing: the pool). A hash held already moves to its new tier."""
        slot = self._add_worker(worker_id)
        bit, keep = 1 << slot, ~(1 << slot)
        mine = self._blocks[worker_id]
        counts = self._counts[worker_id]
        limits = self._limits.get(worker_id)
        holders, tiered = self._holders, self._tiered
        dropped = 0
        for h, tier in zip(hashes, chain(tiers, repeat(0))):
            tier = 1 if tier else 0
            old = mine.get(h)
            if old == tier:
                continue
            if limits is not None and counts[tier] >= limits[tier]:
                dropped += 1  # its share is full: not indexed (a move: not held anywhere)
                if old is not None:
                    self._forget(worker_id, h, keep)
                continue
            mine[h] = tier
            counts[tier] += 1
            if old is None:
                holders[h] = holders.get(h, 0) | bit
            else:
                counts[old] -= 1
            if tier:
                tiered[h] = tiered.get(h, 0) | bit
            elif old:
                _clear(tiered, h, keep)
        if dropped:
            self.dropped[worker_id] = self.dropped.get(worker_id, 0) + dropped

    def removed(self, worker_id: str, hashes: Iterable[BlockHash]) -> None:
        slot = self._slot.get(worker_id)
        if slot is None:
            return
        keep = ~(1 << slot)
        for h in hashes:
            self._forget(worker_id, h, keep)

    def _forget(self, worker_id: str, h: BlockHash, keep: int) -> None:
        old = self._blocks[worker_id].pop(h, None)
        if old is not None:
            self._counts[worker_id][old] -= 1
            _clear(self._holders, h, keep)
            if old:
                _clear(self._tiered, h, keep)

    def reset(self, worker_id: str, hashes: Iterable[BlockHash], tiers: Sequence[int] = ()) -> None:
        """Replace everything known about a worker with a snapshot (`tiers` as in `stored`)."""
        self.remove_worker(worker_id)
        self.stored(worker_id, hashes, tiers)

    def remove_worker(self, worker_id: str) -> None:
        slot = self._slot.pop(worker_id, None)
        if slot is None:
            return
        keep = ~(1 << slot)
        del self._counts[worker_id]
        for h, tier in self._blocks.pop(worker_id).items():
            _clear(self._holders, h, keep)
            if tier:
                _clear(self._tiered, h, keep)
        self._owner[slot] = None

    def match(self, hashes: Sequence[BlockHash]) -> dict[str, PrefixHit]:
        """Leading blocks of `hashes` each worker holds (and how many of those in its tier),
        for workers holding at least one."""
        holders, tiered = self._holders, self._tiered
        alive = holders.get(hashes[0], 0) if hashes else 0
        slow: dict[int, int] = {}  # slot -> tier blocks among its leading blocks so far
        out: dict[str, PrefixHit] = {}
        for depth, h in enumerate(hashes):
            still = alive & holders.get(h, 0)
            self._record(alive & ~still, depth, slow, out)
            alive = still
            if not alive:
                return out
            in_tier = still & tiered.get(h, 0)
            while in_tier:
                low = in_tier & -in_tier
                slot = low.bit_length() - 1
                slow[slot] = slow.get(slot, 0) + 1
                in_tier ^= low
        self._record(alive, len(hashes), slow, out)
        return out

    def _record(
        self, bits: int, depth: int, slow: dict[int, int], out: dict[str, PrefixHit]
    ) -> None:
        while bits:
            low = bits & -bits
            if depth:
                slot = low.bit_length() - 1
                out[self._owner[slot]] = PrefixHit(depth, slow.get(slot, 0))  # type: ignore[index]
            bits ^= low

    def _add_worker(self, worker_id: str) -> int:
        slot = self._slot.get(worker_id)
        if slot is None:
            try:
                slot = self._owner.index(None)
                self._owner[slot] = worker_id
            except ValueError:
                slot = len(self._owner)
                self._owner.append(worker_id)
            self._slot[worker_id] = slot
            self._blocks[worker_id] = {}
            self._counts[worker_id] = [0, 0]
        return slot


def _clear(bitsets: dict[BlockHash, int], h: BlockHash, keep: int) -> None:
    """Keep only the `keep` bits of h's set; an empty set is dropped."""
    bits = bitsets.get(h, 0) & keep
    if bits:
        bitsets[h] = bits
    else:
        bitsets.pop(h, None)
