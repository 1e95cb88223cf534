"""Which workers hold which KV blocks: block hash -> set of workers, kept from the workers'
KV-event streams (stored / removed) and rebuilt from their cached-block snapshots.

Hashes come from `engine.block_hash.compute_block_hashes` — the engine's own function — so a
prompt's hashes here equal the hashes a worker's prefix cache stores, by construction.

Holders of a block are a bit set (an int, one bit per worker slot): matching a prompt against
every worker is one dict lookup and one AND per block, whatever the number of workers.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from engine.block_hash import BlockHash, compute_block_hashes


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
    lora_id: int | None = None, kv_cache_dtype: str = "auto", weights_version: int = 0,
) -> list[BlockHash]:
    """Hashes of the prompt blocks a worker can reuse: full blocks, leaving at least the last
    token to compute (the engine's prefix matching never reuses further). `lora_id`: the
    request's adapter (engine.lora_id_for(name)); it enters every hash, as in the engine.
    `kv_cache_dtype`: the worker's KV format (WorkerInfo.kv_cache_dtype, normalized); a
    quantized one enters every hash too, so workers of one format share hashes.
    `weights_version`: the worker's (WorkerInfo.weights_version), also in every hash."""
    usable = (len(token_ids) - 1) // block_size * block_size if token_ids else 0
    return compute_block_hashes(token_ids[:usable], block_size, cache_salt or None, lora_id,
                                kv_cache_dtype, weights_version)


class KVIndex:
    """Block hash -> workers. Not thread-safe; one event loop owns it."""

    def __init__(self) -> None:
        self._holders: dict[BlockHash, int] = {}  # hash -> bit set of worker slots
        self._slot: dict[str, int] = {}  # worker id -> slot
        self._owner: list[str | None] = []  # slot -> worker id
        self._blocks: dict[str, set[BlockHash]] = {}  # worker id -> its hashes

    def __len__(self) -> int:
        """Distinct block hashes indexed."""
        return len(self._holders)

    def workers(self) -> list[str]:
        return list(self._slot)

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def stored(self, worker_id: str, hashes: Iterable[BlockHash]) -> None:
        bit = 1 << self._add_worker(worker_id)
        mine = self._blocks[worker_id]
        holders = self._holders
        for h in hashes:
            if h not in mine:
                mine.add(h)
                holders[h] = holders.get(h, 0) | bit

    def removed(self, worker_id: str, hashes: Iterable[BlockHash]) -> None:
        slot = self._slot.get(worker_id)
        if slot is None:
            return
        mine = self._blocks[worker_id]
        for h in hashes:
            if h in mine:
                mine.discard(h)
                self._clear(h, ~(1 << slot))

    def reset(self, worker_id: str, hashes: Iterable[BlockHash]) -> None:
        """Replace everything known about a worker with a snapshot."""
        self.remove_worker(worker_id)
        self.stored(worker_id, hashes)

    def remove_worker(self, worker_id: str) -> None:
        slot = self._slot.pop(worker_id, None)
        if slot is None:
            return
        keep = ~(1 << slot)
        for h in self._blocks.pop(worker_id):
            self._clear(h, keep)
        self._owner[slot] = None

    def match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Leading blocks of `hashes` each worker holds, for workers holding at least one."""
        holders = self._holders
        alive = holders.get(hashes[0], 0) if hashes else 0
        out: dict[str, int] = {}
        depth = 0
        for depth, h in enumerate(hashes):
            still = alive & holders.get(h, 0)
            self._record(alive & ~still, depth, out)
            alive = still
            if not alive:
                return out
        self._record(alive, len(hashes), out)
        return out

    def _record(self, bits: int, depth: int, out: dict[str, int]) -> None:
        while bits:
            low = bits & -bits
            if depth:
                out[self._owner[low.bit_length() - 1]] = depth  # type: ignore[index]
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
            self._blocks[worker_id] = set()
        return slot

    def _clear(self, h: BlockHash, keep: int) -> None:
        bits = self._holders.get(h, 0) & keep
        if bits:
            self._holders[h] = bits
        else:
            self._holders.pop(h, None)
