"""A worker's KV events on the wire: what its block pool reports after each engine step,
fanned out to every `SubscribeKVEvents` stream (the routers' KV indexes), and the
`GetCachedBlocks` snapshot they rebuild from."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.kv.block_pool import KVEvent
from proto import pdserve_pb2 as pb


class KVEventFanout:
    """Subscribers' queues (asyncio side); `publish` is called from the engine thread."""

    def __init__(self) -> None:
        self._subscribers: set[asyncio.Queue[pb.KVEventBatch]] = set()

    def publish(self, aio: asyncio.AbstractEventLoop, events: list[KVEvent]) -> None:
        """Engine thread: one step's events to every subscriber, as one batch."""
        if events and self._subscribers:
            batch = kv_event_batch(events)
            for q in list(self._subscribers):
                aio.call_soon_threadsafe(q.put_nowait, batch)

    async def subscribe(self) -> AsyncIterator[pb.KVEventBatch]:
        queue: asyncio.Queue[pb.KVEventBatch] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers.discard(queue)


def kv_event_batch(events: list[KVEvent]) -> pb.KVEventBatch:
    """One step's KV events as one batch. A batch is unordered (the router applies its
    removals, then its stores), so each hash appears once, in the state of its last event;
    `stored_tiers` is sent only when some stored hash sits in the second tier (empty: all in
    the pool)."""
    final: dict[bytes, KVEvent] = {e.block_hash: e for e in events}
    stored = [e for e in final.values() if e.stored]
    tiers = [e.tier for e in stored]
    return pb.KVEventBatch(
        stored=[e.block_hash for e in stored],
        removed=[e.block_hash for e in final.values() if not e.stored],
        stored_tiers=tiers if any(tiers) else [],
    )


def kv_snapshot(pool: list[bytes], tier: list[bytes]) -> pb.CachedBlocksResponse:
    """A `GetCachedBlocks` answer: the hashes held in the pool, then those in the second tier
    (`tiers` only when there are some: empty reads as all in the pool)."""
    return pb.CachedBlocksResponse(
        block_hashes=pool + tier, tiers=[0] * len(pool) + [1] * len(tier) if tier else []
    )
