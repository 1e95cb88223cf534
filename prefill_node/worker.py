"""The prefill worker.

Life cycle of a request here:
1. `Prefill` arrives from a decode worker D with the prompt, sampling settings (n = 1, seed
   set) and the destination: D's transfer identity and D's block ids for the prompt blocks
   D does not have yet — or, `deferred`, without the block ids: D parks the request while
   this worker computes, and sends them in `SetDestination` (same transfer id; whichever of
   the two calls arrives first makes the slot). Nothing is written before they come; a
   prompt that finishes first keeps its blocks pinned until then or its deadline. From the
   destination on, the transfer follows its progress: keepalives tell D the prompt is still
   computing (or queued) here, however long it takes; only a stalled write or silence fails it.
2. D must be a registered worker: a registration in etcd must name its NIXL metadata
   (PERMISSION_DENIED otherwise, nothing sent). D's peer is added (compatibility check; a
   no-op for known peers — peers are also added ahead of time as decode workers appear in
   etcd). A D whose KV layout differs (model, KV cache dtype and scale layout, block shape)
   is refused: FAILED_PRECONDITION naming both formats, nothing written; D then prefills
   locally (or fails with --strict-remote-prefill). With a `kv_source` (a peer holding more
   of the prompt's leading blocks than this worker), those are pulled into the prefix cache
   first (worker_runtime/kv_pull.py; a failed pull only means computing them). The prompt
   enters this engine (chunked prefill, own prefix cache) with max_tokens = 1.
3. After every engine step the KV streamer writes the blocks that became complete into D's
   blocks; when the first token is sampled, the rest goes out with the completion
   notification. The engine request is finished at that point: its blocks are only pinned
   until the writes complete, then they are cached-free.
4. The response (first token, cached-token count, blocks sent) is returned once every write
   completed. A failed write (D died) or a stalled one fails the call; the caller cancelling
   aborts the request and frees everything once the sender reported the transfer (a write the
   transport cannot cancel yet keeps our source blocks pinned until it can).
5. `Worker.Abort` (D, after cancelling or losing its call): the request is aborted here and
   the answer waits until no transfer of it is in flight — D releases the blocks it kept
   out of reuse on that answer, so it is the promise that no write of ours lands later.

A worker that serves the decode role now refuses `Prefill` and `Embed` (FAILED_PRECONDITION;
UNAVAILABLE while switching roles: worker_runtime/roles.py); its decode worker prefills locally.

`Embed` (the router's /v1/embeddings) is a prompt-only request with no decode worker: the
prompt runs in this engine like any other (batched, chunked, own prefix cache) as a pooling
request (engine/sampling/pooling.py) and the call returns its embedding; no KV leaves the worker.
Cancelling the call or `Worker.Abort` aborts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

from cluster.convert import request_lora, sampled_to_pb, sampling_from_pb
from cluster.roles import Role
from engine.core.limits import EngineLimits
from engine.llm_engine import LLMEngine
from engine.processing.outputs import CompletionDelta
from engine.processing.tokens import SampledToken
from engine.sampling.pooling import PoolingParams, PoolingType
from engine.sampling.sampling_params import SamplingParams
from kvtransfer import TransferResult, TransferStatus
from prefill_node.kv_streamer import KVStreamer, Outgoing
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from worker_runtime.contexts import PrefillContext
from worker_runtime.grpc_errors import ResourceExhausted, Unavailable
from worker_runtime.kv_pull import KVPuller
from worker_runtime.peers import RegisteredPeers

log = logging.getLogger(__name__)

MAX_PENDING_DESTINATIONS = 4096
"""Deferred destinations a prefill worker keeps at once (SetDestination beyond:
RESOURCE_EXHAUSTED)."""


class PrefillWorker(pb_grpc.PrefillWorkerServicer):
    """The `PrefillWorker` service (thin: `from_pb -> engine -> to_pb`; the KV leaves
    through `KVStreamer`). It sees the worker through `PrefillContext` only."""

    def __init__(self, ctx: PrefillContext, peers: RegisteredPeers, puller: KVPuller) -> None:
        self.ctx = ctx
        self.peers = peers
        self.puller = puller
        self.streamer = KVStreamer(ctx.sender)
        ctx.listen_sender(self.streamer.answer_early)
        ctx.add_step_hook(self.streamer.after_step)
        ctx.add_abort_hook(self.abort)
        self._embeds: dict[str, asyncio.Queue[CompletionDelta | None]] = {}  # None: aborted
        # Deferred destinations, by transfer id.
        self._destinations: dict[str, asyncio.Future[pb.KVDestination]] = {}

    async def Prefill(self, request: pb.PrefillRequest, context):
        with self.ctx.admitted(Role.PREFILL, request.request_id):
            tid = request.destination.transfer_id
            if not request.destination.deferred or not tid:
                return await self._prefill(request, None)
            slot = self._destination_slot(tid)
            try:
                return await self._prefill(request, slot)
            finally:
                if self._destinations.get(tid) is slot:
                    del self._destinations[tid]

    async def _prefill(
        self, request: pb.PrefillRequest, slot: asyncio.Future[pb.KVDestination] | None
    ) -> pb.PrefillResponse:
        """`slot`: where a deferred destination arrives (SetDestination), else None."""
        ctx = self.ctx
        params = sampling_from_pb(request.sampling)
        if params.n != 1 or params.seed is None or params.max_tokens != 1:
            raise ValueError("prefill requests need n == 1, max_tokens == 1 and a seed")
        dest = request.destination
        limits = ctx.limits
        # Deferred: the block ids come in SetDestination; keep every prompt block until then.
        skips = (
            [0] * limits.kv_groups
            if slot is not None
            else _destination_skips(dest, limits, len(request.prompt_token_ids))
        )
        if not dest.transfer_id:
            raise ValueError("destination.transfer_id is required")
        await self.peers.check(dest.peer_metadata)
        peer = await asyncio.to_thread(ctx.add_peer, dest.peer_metadata)
        # A structured request compiles its grammar here (the first token obeys it), a LoRA
        # request loads its adapter if needed (the decode worker's).
        req = await ctx.make_request(
            request.request_id,
            list(request.prompt_token_ids),
            params,
            request.cache_salt,
            request.priority,
            request_lora(request),
        )
        req.keep_blocks_from = skips  # streamed out: kept whatever the windows
        if request.HasField("kv_source"):  # a peer holds more of the prompt: pull, then compute
            await self.puller.pull(req, request.kv_source)
        done: asyncio.Future[tuple[TransferResult, SampledToken | None, float]]
        done = ctx.create_future()

        def on_done(result: TransferResult, first_token: SampledToken | None) -> None:
            # When the sender saw the last write complete (the answer's delay is from here).
            ctx.settle(done, (result, first_token, time.monotonic()))

        out = Outgoing(
            request=req,
            transfer_id=dest.transfer_id,
            peer=peer,
            dest_blocks=None if slot is not None else list(dest.block_ids),
            group_skips=None if slot is not None else skips,
            deadline=time.monotonic() + (dest.deadline_s or ctx.kv_timeout_s),
            idle_s=dest.deadline_s or ctx.kv_timeout_s,
            on_done=on_done,
        )

        def start(engine: LLMEngine) -> None:
            engine.submit(req)  # raises RequestRejected for prompts that can never fit
            self.streamer.add(out)

        await ctx.call(start)
        placing = (
            None if slot is None else asyncio.ensure_future(self._place_when_given(slot, out, done))
        )
        try:
            result, first_token, completed_at = await done
        except BaseException:  # cancelled, or a destination that does not fit the prompt
            await asyncio.shield(
                ctx.call(lambda e: self._cancel(e, dest.transfer_id, req.request_id))
            )
            raise
        finally:
            if placing is not None:
                placing.cancel()
        if result.status is not TransferStatus.COMPLETE:
            raise Unavailable(
                f"KV transfer to {peer} failed: {result.status.name.lower()} {result.error}".strip()
            )
        assert first_token is not None, "a complete transfer carries the first token"
        return pb.PrefillResponse(
            first_token=sampled_to_pb(first_token),
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_blocks_sent=result.num_blocks,
            # From the last write's post returning (its bytes have landed on one host),
            # through the transport's acknowledgement, to now.
            answer_delay_s=time.monotonic() - completed_at + result.settle_s,
        )

    async def SetDestination(self, request: pb.KVDestination, context):
        """The block ids and skips of a Prefill whose destination was deferred (its caller
        parked the request while this worker already computed it). Answered once taken: a
        destination that does not fit the prompt fails that Prefill call. Not gated by role or
        drain: it only completes a Prefill this worker admitted (one that never comes leaves a
        slot for kv_timeout, at most MAX_PENDING_DESTINATIONS of them)."""
        if not request.transfer_id:
            raise ValueError("transfer_id is required")
        if (
            request.transfer_id not in self._destinations
            and len(self._destinations) >= MAX_PENDING_DESTINATIONS
        ):
            raise ResourceExhausted(f"{MAX_PENDING_DESTINATIONS} destinations are already waiting")
        slot = self._destination_slot(request.transfer_id)
        if slot.done():
            raise ValueError(f"transfer {request.transfer_id!r} already has its destination")
        slot.set_result(request)
        return pb.SetDestinationResponse()

    def _destination_slot(self, transfer_id: str) -> asyncio.Future[pb.KVDestination]:
        """Where transfer_id's deferred destination arrives; whichever of its Prefill and its
        SetDestination comes first makes it. One SetDestination made and no Prefill took is
        dropped after kv_timeout."""
        slot = self._destinations.get(transfer_id)
        if slot is None:
            slot = self._destinations[transfer_id] = self.ctx.create_future()
            self.ctx.call_later(self.ctx.kv_timeout_s, self._drop_unclaimed, transfer_id, slot)
        return slot

    def _drop_unclaimed(self, transfer_id: str, slot: asyncio.Future[pb.KVDestination]) -> None:
        if self._destinations.get(transfer_id) is slot and slot.done():  # no Prefill waits on it
            del self._destinations[transfer_id]

    async def _place_when_given(
        self, slot: asyncio.Future[pb.KVDestination], out: Outgoing, done: asyncio.Future[Any]
    ) -> None:
        """Hand the deferred destination to the streamer once it comes; one that does not
        fit the prompt fails the Prefill (through `done`)."""
        given: pb.KVDestination = await slot
        # Open the transfer now, not on the engine thread: `place` waits for the step in
        # progress, which may be a long chunk of another prompt, while D's progress window
        # runs from when it parked the request.
        self.streamer.open(out)

        def place(engine: LLMEngine) -> None:
            if self.streamer.active.get(out.transfer_id) is not out:
                self.streamer.sender.cancel(out.transfer_id)  # no keepalives for it
                return  # ended already (cancelled, failed, timed out): its call says why
            skips = _destination_skips(given, engine.limits, out.request.num_prompt_tokens)
            self.streamer.set_destination(engine, out.transfer_id, list(given.block_ids), skips)

        try:
            await self.ctx.call(place)
        except ValueError as exc:
            if not done.done():
                done.set_exception(exc)

    async def Embed(self, request: pb.EmbedRequest, context):
        with self.ctx.admitted(Role.PREFILL, request.request_id):
            return await self._embed(request)

    async def _embed(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        ctx, rid = self.ctx, request.request_id
        # PoolingParams checks the type named (ValueError for an unknown one).
        pooling = PoolingParams(
            cast(PoolingType, request.pooling_type or "last"),
            request.normalize if request.HasField("normalize") else True,
        )
        req = await ctx.make_request(
            rid,
            list(request.prompt_token_ids),
            SamplingParams(max_tokens=1),
            request.cache_salt,
            request.priority,
            pooling=pooling,
        )
        ctx.limits.check_fits(req.num_tokens)  # invalid input fails before any work
        queue = ctx.open_stream(rid)
        self._embeds[rid] = queue
        try:
            await ctx.call(lambda e: e.submit(req))
            delta = await queue.get()
        except asyncio.CancelledError:
            await ctx.call(lambda e: e.abort_request(rid), cancellable=False)
            raise
        finally:
            ctx.close_stream(rid)
            self._embeds.pop(rid, None)
        if delta is None or delta.embedding is None:
            raise Unavailable(f"request {rid} was aborted")
        ctx.metrics.embeddings.inc()
        return pb.EmbedResponse(
            embedding=delta.embedding,
            num_prompt_tokens=delta.num_prompt_tokens,
            num_cached_tokens=delta.num_cached_tokens,
        )

    def _cancel(self, engine: LLMEngine, transfer_id: str, request_id: str) -> None:
        self.streamer.cancel(engine, transfer_id)
        engine.abort_request(request_id)

    async def abort(self, request_id: str) -> bool:
        """`Worker.Abort`: abort the request and answer once none of its writes can still
        land in the decode worker's blocks (its transfers were reported by the sender)."""
        ended: asyncio.Future[None] = self.ctx.create_future()

        def stop(engine: LLMEngine) -> bool:
            found = self.streamer.cancel_request(engine, request_id)
            found |= bool(engine.abort_request(request_id))
            self.streamer.when_ended(request_id, lambda: self.ctx.settle(ended))
            return found

        found = await self.ctx.call(stop, cancellable=False)
        await ended
        embed = self._embeds.get(request_id)
        if embed is not None:  # aborted in the engine above: its Embed call ends
            embed.put_nowait(None)
        return found


def _destination_skips(
    dest: pb.KVDestination, limits: EngineLimits, num_prompt_tokens: int
) -> list[int]:
    """Each KV group's skipped leading blocks of a destination, checked against the prompt:
    block_ids holds each group's blocks after its skip, group after group. ValueError if not."""
    prompt_blocks = limits.blocks_for(num_prompt_tokens)
    skips = list(dest.group_skip_blocks) or [dest.num_skip_blocks] * limits.kv_groups
    if (
        len(skips) != limits.kv_groups
        or not all(0 <= s <= prompt_blocks for s in skips)
        or len(dest.block_ids) != sum(prompt_blocks - s for s in skips)
    ):
        raise ValueError(
            f"destination skips {skips} and covers {len(dest.block_ids)} blocks; the prompt "
            f"has {prompt_blocks} in each of {limits.kv_groups} KV groups"
        )
    return skips
