"""Feeds the KV index from every registered worker.

Per worker, for as long as it is registered: open `SubscribeKVEvents`, wait (briefly) until
the worker acknowledges the subscription with its initial metadata, take the
`GetCachedBlocks` snapshot, replace the worker's index entries with it, then apply each event
batch (removals, then stores) as it arrives. Snapshot and stores say where each block is (the
pool or the second tier; a worker that says nothing: the pool). Events that happened before
the snapshot are replayed on top of it; each hash ends in the state of its last event, so the
result is exact.
On any stream error the worker's entries are dropped and the loop starts over after a backoff.
A worker's share of the index is bounded by the capacity it registered with (its pool's and
its second tier's blocks, `KVIndex.set_limit`): stores beyond it are dropped, counted
(`KVIndex.dropped`) and logged once per subscription.
"""

from __future__ import annotations

import asyncio
import logging

from cluster.registration import WorkerInfo
from cluster.retry import reconnect_forever
from proto import pdserve_pb2
from router.channels import ChannelPool
from router.placement.index import KVIndex

log = logging.getLogger(__name__)


class KVSubscriptions:
    def __init__(self, index: KVIndex, channels: ChannelPool, ack_timeout_s: float = 0.25) -> None:
        self.index = index
        self.channels = channels
        self.ack_timeout_s = ack_timeout_s
        self._tasks: dict[str, asyncio.Task] = {}
        self.synced: dict[str, asyncio.Event] = {}  # worker id -> snapshot applied

    def on_added(self, info: WorkerInfo) -> None:
        self.synced[info.worker_id] = asyncio.Event()
        self._tasks[info.worker_id] = asyncio.get_running_loop().create_task(
            self._follow(info), name=f"kv-events-{info.worker_id}"
        )

    def on_new_weights(self, info: WorkerInfo) -> None:
        """The worker's blocks of its older weights version can never match again (the
        version is in every hash): drop them; its stream goes on with the new ones."""
        self.index.remove_worker(info.worker_id)

    def on_removed(self, info: WorkerInfo) -> None:
        task = self._tasks.pop(info.worker_id, None)
        if task is not None:
            task.cancel()
        self.synced.pop(info.worker_id, None)
        self.index.remove_worker(info.worker_id)
        self.index.set_limit(info.worker_id, None)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, info: WorkerInfo) -> None:
        async def session() -> None:  # ends when the worker closes the stream: resubscribe
            try:
                await self._subscribe_once(info)
            finally:
                self.index.remove_worker(info.worker_id)
                if info.worker_id in self.synced:
                    self.synced[info.worker_id].clear()

        await reconnect_forever(session, f"KV events from {info.worker_id}", log, logging.INFO)

    def _warn_dropped(self, info: WorkerInfo, before: int) -> int:
        """Log the first stores of a subscription dropped for the worker's bound; returns
        the drop count to compare with next (-1 once logged)."""
        now = self.index.dropped.get(info.worker_id, 0)
        if before >= 0 and now > before:
            log.warning(
                "KV index: worker %s sent more blocks than it registered (%d in its pool, %d "
                "in its tier): %d dropped so far",
                info.worker_id,
                info.capacity.total_blocks,
                info.capacity.kv_offload_total_blocks,
                now,
            )
            return -1
        return before

    async def _subscribe_once(self, info: WorkerInfo) -> None:
        cap = info.capacity
        self.index.set_limit(info.worker_id, cap.total_blocks, cap.kv_offload_total_blocks)
        dropped = self.index.dropped.get(info.worker_id, 0)
        stub = self.channels.worker(info.grpc_address)
        call = stub.SubscribeKVEvents(pdserve_pb2.KVEventsRequest())
        try:
            try:
                async with asyncio.timeout(self.ack_timeout_s):
                    await call.initial_metadata()
            except TimeoutError:
                pass  # the worker sends no early metadata: a small window of missed events
            snapshot = await stub.GetCachedBlocks(pdserve_pb2.CachedBlocksRequest(), timeout=10)
            self.index.reset(info.worker_id, snapshot.block_hashes, snapshot.tiers)
            self.synced[info.worker_id].set()
            log.debug("KV index: %d blocks from %s", len(snapshot.block_hashes), info.worker_id)
            dropped = self._warn_dropped(info, dropped)
            async for batch in call:
                self.index.removed(info.worker_id, batch.removed)
                self.index.stored(info.worker_id, batch.stored, batch.stored_tiers)
                dropped = self._warn_dropped(info, dropped)
        finally:
            call.cancel()
