"""The holder's side of a peer pull (`Worker.SendBlocks`): send the blocks a peer asks for by
hash into the blocks it reserved (worker_runtime/kv_pull.py has the puller's side).

Life cycle of a send here:
1. The destination must be a registered worker of this cluster (RegisteredPeers.check) with
   a compatible KV layout (`add_peer`'s check): refused before anything is read otherwise.
2. Engine thread: the blocks holding the hashes are pinned — pool blocks as they are, tier
   blocks promoted into the pool first (BlockPool.hold_cached). A hash held nowhere here
   any more (evicted since the router looked) fails the call with FAILED_PRECONDITION and
   nothing is sent: the puller computes instead.
3. One batch of writes with the completion notification. Each step the sender is polled; when
   it reports the transfer, the pins are dropped (the blocks are cached-free again) and the
   call answers: from then on nothing of ours lands in the puller's blocks.
4. The caller cancelling, or `Worker.Abort` with the transfer id (the puller after losing
   its call), cancels the writes; Abort answers once the sender reported the transfer. An
   Abort that overtakes its SendBlocks (the call still queued here) leaves the transfer id
   refused for good, so no write of it can start after the puller was told none would.
The blocks are pinned only for the copy, exactly like a prefill worker's streamed blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from engine.llm_engine import LLMEngine
from kvtransfer import TransferResult, TransferStatus
from proto import pdserve_pb2 as pb
from worker_runtime.contexts import PULL_PREFIX, ExportContext
from worker_runtime.grpc_errors import FailedPrecondition, Unavailable
from worker_runtime.peers import RegisteredPeers

_REFUSED_IDS = 4096  # aborted-before-start transfer ids remembered (oldest forgotten first)


@dataclass(slots=True)
class _Send:
    transfer_id: str
    pinned: list[int]
    done: asyncio.Future[TransferResult]
    """Settled with the sender's TransferResult once it reported the transfer."""
    waiters: list[asyncio.Future[None]] = field(default_factory=list)


class KVExporter:
    def __init__(self, ctx: ExportContext, peers: RegisteredPeers) -> None:
        self.ctx = ctx
        self.peers = peers
        self._active: dict[str, _Send] = {}  # engine thread: by transfer id
        self._refused: OrderedDict[str, None] = OrderedDict()  # engine thread: aborted early
        ctx.add_step_hook(self._after_step)
        ctx.add_abort_hook(self.abort)

    async def send_blocks(self, request: pb.SendBlocksRequest) -> pb.SendBlocksResponse:
        ctx, dest = self.ctx, request.destination
        tid = dest.transfer_id
        if not tid:
            raise ValueError("destination.transfer_id is required")
        if len(dest.block_ids) != len(request.block_hashes):
            raise ValueError(
                f"{len(request.block_hashes)} block hashes but "
                f"{len(dest.block_ids)} destination blocks"
            )
        if not request.block_hashes:
            raise ValueError("block_hashes must not be empty")
        if dest.num_skip_blocks or dest.group_skip_blocks:
            raise ValueError(
                "destination.num_skip_blocks / group_skip_blocks are for Prefill; "
                "SendBlocks sends every block it names"
            )
        await self.peers.check(dest.peer_metadata)
        peer = await asyncio.to_thread(ctx.add_peer, dest.peer_metadata)
        done: asyncio.Future[TransferResult] = ctx.create_future()
        deadline = time.monotonic() + (dest.deadline_s or ctx.kv_timeout_s)
        hashes, targets = list(request.block_hashes), list(dest.block_ids)

        def start(engine: LLMEngine) -> int:
            if tid in self._active or tid in self._refused:
                raise ValueError(f"transfer {tid!r} is already being sent, or was aborted")
            pinned = engine.block_manager.pool.hold_cached(hashes)
            if pinned is None:
                return 0
            send = self._active[tid] = _Send(tid, pinned, done)
            try:
                ctx.sender.send(
                    tid, peer, list(zip(pinned, targets)), final=True, deadline=deadline
                )
            except Exception as exc:  # refused before posting
                self._finish(
                    engine,
                    send,
                    TransferResult(tid, TransferStatus.ERROR, peer, 0, 0, 0.0, str(exc)),
                )
            return len(pinned)

        if not await ctx.call(start):
            ctx.metrics.kv_exports.labels("missing").inc()
            raise FailedPrecondition(
                "this worker no longer holds every block asked for "
                "(evicted since it was placed): compute them"
            )
        try:
            result: TransferResult = await done
        except asyncio.CancelledError:
            await asyncio.shield(ctx.call(lambda e: self._cancel(e, tid)))
            raise
        if result.status is not TransferStatus.COMPLETE:
            ctx.metrics.kv_exports.labels("failed").inc()
            raise Unavailable(
                f"sending blocks to {peer} failed: "
                f"{result.status.name.lower()} {result.error}".strip()
            )
        ctx.metrics.kv_exports.labels("sent").inc()
        ctx.metrics.kv_export_blocks.inc(result.num_blocks)
        return pb.SendBlocksResponse(num_blocks_sent=result.num_blocks)

    async def abort(self, request_id: str) -> bool:
        """`Worker.Abort` for a send in flight: cancel it and answer once none of its writes
        can still land (the sender reported it). False if no send has that id."""
        ended: asyncio.Future[None] = self.ctx.create_future()

        def stop(engine: LLMEngine) -> bool:
            send = self._active.get(request_id)
            if send is None:
                if request_id.startswith(PULL_PREFIX):  # its SendBlocks may still be queued
                    self._refused[request_id] = None
                    while len(self._refused) > _REFUSED_IDS:
                        self._refused.popitem(last=False)
                return False
            send.waiters.append(ended)
            self._cancel(engine, request_id)
            return True

        if not await self.ctx.call(stop, cancellable=False):
            return False
        await ended
        return True

    # ---- engine thread ----------------------------------------------------------------------
    def _cancel(self, engine: LLMEngine, tid: str) -> None:
        send = self._active.get(tid)
        if (
            send is not None
            and not self.ctx.sender.cancel(tid)
            and self.ctx.sender.status(tid) is None
        ):
            # The sender never heard of it (nothing posted): finish it here; otherwise its
            # poll reports it once none of its writes can still read our blocks.
            self._finish(
                engine,
                send,
                TransferResult(tid, TransferStatus.CANCELLED, None, 0, 0, 0.0, "cancelled"),
            )

    def _after_step(self, engine: LLMEngine) -> bool:
        if not self._active:
            return False  # nothing sent: no sender result can be ours
        for result in self.ctx.sender.poll():
            send = self._active.get(result.request_id)
            if send is not None:
                self._finish(engine, send, result)
        return bool(self._active)

    def _finish(self, engine: LLMEngine, send: _Send, result: TransferResult) -> None:
        del self._active[send.transfer_id]
        engine.block_manager.pool.release(send.pinned)
        self.ctx.settle(send.done, result)
        for waiter in send.waiters:
            self.ctx.settle(waiter)
