"""Pulling a prompt's leading KV blocks from a peer that holds them, instead of computing them.

The router names a holder (`KVSource`: a worker whose pool or second tier holds more of the
prompt's leading blocks than this one) when it judged pulling faster than recomputing. The
worker that will compute the prompt (the prefill worker, or a decode worker prefilling
locally) pulls before its engine sees the request; the request then finds those blocks in the
prefix cache and computes only the rest.

Life cycle of a pull here (engine-thread steps are single commands):
1. Reserve: the blocks this worker lacks (past its own prefix hit, up to the holder's count)
   are taken from the free list, held outside any table, and the receiver expects writes into
   them under a transfer id of their own (`PULL_PREFIX`).
2. `Worker.SendBlocks` on the holder names their hashes and our block ids; the holder pins
   the blocks that hold those hashes (promoting tier ones), writes them over NIXL with one
   notification, and answers once its writes completed (worker_runtime/kv_export.py).
3. Landed (receiver COMPLETE) and answered: the blocks join the prefix cache under their
   hashes (`BlockPool.adopt`) and the caller submits its request.
Any failure — the holder lost a block, refused, died, or the pull missed its deadline —
returns 0 and the caller computes the prompt as if nothing was pulled; the request never
fails for it. The reserved blocks stay out of reuse until the holder confirmed it writes no
more (`confirm_stopped`), then go back to the pool.

The deadline is what recomputing those tokens would take at this worker's measured prefill
rate (twice that, plus `_CALL_ALLOWANCE_S` for the round trip), capped by --kv-timeout: a
pull slower than computing is abandoned.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

from engine.core.request import Request
from engine.kv.block_hash import BlockHash
from engine.llm_engine import LLMEngine
from kvtransfer import TransferStatus
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from worker_runtime.contexts import PULL_PREFIX, PullContext
from worker_runtime.peer_calls import PeerChannels, confirm_stopped

log = logging.getLogger(__name__)

_CALL_ALLOWANCE_S = 0.1


class PullFailed(Exception):
    """The pulled blocks did not all land (the receiver's terminal status says why)."""


@dataclass(frozen=True, slots=True)
class _Plan:
    transfer_id: str
    hashes: list[BlockHash]
    block_ids: list[int]
    deadline_s: float


class KVPuller:
    """This worker's pulls (asyncio side: `pull`; engine thread: the `_` commands)."""

    def __init__(self, ctx: PullContext) -> None:
        self.ctx = ctx
        self._ids = itertools.count()
        self._channels = PeerChannels(ctx.auth)
        self._held: dict[str, list[int]] = {}  # engine thread: reserved blocks by transfer id
        self._landed: dict[str, asyncio.Future[None]] = {}  # engine thread: settled by the receiver
        self._background: set[asyncio.Task[None]] = set()
        ctx.add_step_hook(self._after_step)

    async def pull(self, req: Request, source: pb.KVSource | None) -> int:
        """Pull the leading prompt blocks of `req` that `source` holds and this worker lacks
        into its prefix cache. Returns the prompt tokens pulled (0: none — nothing to pull,
        no room, or the pull failed; the caller computes them). Raises only CancelledError."""
        if source is None or source.num_blocks == 0 or source.worker_id == self.ctx.worker_id():
            return 0
        metrics = self.ctx.metrics
        tid = f"{PULL_PREFIX}{req.request_id}:{next(self._ids)}"
        landed = self.ctx.create_future()
        try:
            plan = await self.ctx.call(
                lambda e: self._reserve(e, req, source, tid, landed), cancellable=False
            )
        except ValueError as exc:  # this pool cannot take pulled blocks (several KV groups)
            log.info("not pulling KV for %s: %s", req.request_id, exc)
            plan = None
        if plan is None:
            metrics.kv_pulls.labels("skipped").inc()
            return 0
        started = time.monotonic()
        call = pb_grpc.WorkerStub(self._channels.get(source.address)).SendBlocks(
            pb.SendBlocksRequest(
                block_hashes=plan.hashes,
                destination=pb.KVDestination(
                    peer_metadata=self.ctx.own_metadata(),
                    block_ids=plan.block_ids,
                    # The holder stops writing before we stop waiting.
                    deadline_s=0.9 * plan.deadline_s,
                    transfer_id=tid,
                ),
            ),
            timeout=plan.deadline_s,
        )
        try:
            await call
            await landed
        except asyncio.CancelledError:
            call.cancel()
            self._release_when_stopped(source, tid)
            raise
        except Exception as exc:  # refused, failed, or too slow: compute instead
            if landed.done() and not landed.cancelled():
                landed.exception()  # retrieved: the call's failure is the one reported
            log.info(
                "pull of %d blocks for %s from %s failed (%s); computing them",
                len(plan.block_ids),
                req.request_id,
                source.worker_id,
                _describe(exc),
            )
            self._release_when_stopped(source, tid)
            metrics.kv_pulls.labels("failed").inc()
            return 0
        await self.ctx.call(lambda e: self._adopt(e, plan), cancellable=False)
        elapsed = time.monotonic() - started
        # Published (Capacity.kv_pull_*): the router weighs pulling against computing with
        # it. Call to adoption, so the round trip and the holder's wait are in it.
        self.ctx.observe_pull(len(plan.block_ids), elapsed)
        metrics.kv_pulls.labels("pulled").inc()
        metrics.kv_pull_blocks.inc(len(plan.block_ids))
        metrics.kv_pull_seconds.observe(elapsed)
        return len(plan.block_ids) * self.ctx.block_size

    # ---- engine thread ----------------------------------------------------------------------
    def _reserve(
        self,
        engine: LLMEngine,
        req: Request,
        source: pb.KVSource,
        tid: str,
        landed: asyncio.Future[None],
    ) -> _Plan | None:
        """Reserve the blocks to pull and expect them; None if there is nothing to pull (the
        prefix cache is off, the request computes its whole prompt, this worker already holds
        as much) or no room for them now."""
        bm = engine.block_manager
        if not bm.enable_prefix_caching or req.computes_whole_prompt:
            return None
        usable = (req.num_tokens - 1) // bm.block_size  # matching always leaves a token
        want = min(source.num_blocks, usable, len(req.block_hashes))
        have = bm.match_prefix(req).num_tokens // bm.block_size
        if want <= have:
            return None
        block_ids = bm.pool.reserve(want - have)
        if block_ids is None:
            return None
        deadline_s = self._deadline_s((want - have) * bm.block_size)
        try:
            self.ctx.receiver.expect(tid, block_ids, deadline=time.monotonic() + deadline_s)
        except Exception:
            bm.pool.release(block_ids)
            raise
        self._held[tid], self._landed[tid] = block_ids, landed
        return _Plan(tid, req.block_hashes[have:want], block_ids, deadline_s)

    def _deadline_s(self, num_tokens: int) -> float:
        cap = self.ctx.kv_timeout_s
        rate = self.ctx.prefill_tokens_per_s()
        return min(cap, 2 * num_tokens / rate + _CALL_ALLOWANCE_S) if rate > 0 else cap

    def _adopt(self, engine: LLMEngine, plan: _Plan) -> None:
        engine.block_manager.pool.adopt(plan.hashes, self._held.pop(plan.transfer_id))

    def _release(self, engine: LLMEngine, tid: str) -> None:
        """The holder writes nothing more: the reserved blocks go back to the pool."""
        self.ctx.receiver.cancel(tid)
        self._landed.pop(tid, None)
        block_ids = self._held.pop(tid, None)
        if block_ids is not None:
            engine.block_manager.pool.release(block_ids)

    def _after_step(self, engine: LLMEngine) -> bool:
        if not self._landed:
            return bool(self._held)  # nothing expected: no receiver result can be ours
        for result in self.ctx.receiver.poll():
            landed = self._landed.pop(result.request_id, None)
            if landed is None:
                continue  # released earlier
            if result.status is TransferStatus.COMPLETE:
                self.ctx.settle(landed)
            else:
                self.ctx.settle(
                    landed, exc=PullFailed(f"{result.status.name.lower()}: {result.error}".strip())
                )
        return bool(self._held)

    # ---- failure -----------------------------------------------------------------------------
    def _release_when_stopped(self, source: pb.KVSource, tid: str) -> None:
        """In the background: once the holder confirmed it writes nothing more for `tid`,
        release the reserved blocks."""

        async def release() -> None:
            await confirm_stopped(self._channels.get(source.address), tid, self.ctx.kv_timeout_s)
            await self.ctx.call(lambda e: self._release(e, tid), cancellable=False)

        task = self.ctx.create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _describe(exc: Exception) -> str:
    code = getattr(exc, "code", None)
    if callable(code):
        return f"{code().name}: {exc.details()}"  # type: ignore[attr-defined]
    return f"{type(exc).__name__}: {exc}"
