"""The decode worker.

Life cycle of a request here:
1. `Generate` arrives (from the router) with the prompt's token ids and, optionally, the
   prefill worker P to use.
2. With P (and n == 1): the engine allocates the prompt's blocks, reusing its own prefix-cache
   hits, and parks the request as WAITING_FOR_KV; the KV receiver is told to expect writes into
   the blocks still missing; then P's `Prefill` is called with our transfer identity and those
   block ids. P streams the blocks as its chunks complete and returns the first token.
3. When every block has landed (receiver COMPLETE) and the first token is back, the request
   joins the running batch; its first token is streamed at once, then every decoded token.
4. Failures: P unreachable or failing -> the parked request is dropped (blocks freed) and the
   prompt is prefilled here (`local_fallback`), or UNAVAILABLE with --strict-remote-prefill;
   KV not complete by the deadline -> DEADLINE_EXCEEDED, blocks freed, nothing decoded from
   them; the caller cancelling -> the request is aborted and its blocks freed.
5. `Worker.Abort` (an operator, or a router migrating the request): the stream ends with a
   final "abort" update per unfinished completion; a request whose KV is still on its way is
   dropped like a cancelled one (its blocks stay quarantined until P can no longer write).
Without P (or n > 1, with prompt logprobs, or resumed after a migration) the prompt is
prefilled here (`local`).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Awaitable, TypeVar

import grpc

from cluster.convert import (delta_to_pb, resume_from_pb, sampled_from_pb, sampling_from_pb,
                             sampling_to_pb)
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionDelta
from engine.request import Request
from engine.scheduler import SampledToken
from kvtransfer import TransferStatus
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from worker_runtime.grpc_errors import Unavailable, grpc_errors
from worker_runtime.runtime import WorkerRuntime

log = logging.getLogger(__name__)
T = TypeVar("T")
_ABORT = object()  # put on a request's stream queue by `abort`


class RequestAborted(Exception):
    """`Worker.Abort` was called for a request this worker is streaming."""


@dataclass
class _RemotePrefill:
    """Engine-thread state of one request waiting for its KV."""

    request_id: str
    transfer_id: str
    block_ids: list[int]  # our blocks the prefill worker writes into
    done: asyncio.Future  # resolved on the asyncio loop: None (started) or an exception
    call_ended: bool = False  # the Prefill call returned or failed: no more writes can come
    kv_landed: bool = False
    first_token: SampledToken | None = None
    deltas: list = field(default_factory=list)


class DecodeWorker(pb_grpc.DecodeWorkerServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime
        self._pending: dict[str, _RemotePrefill] = {}  # engine thread only
        self._by_transfer: dict[str, str] = {}  # engine thread only
        # Blocks of failed transfers whose Prefill call may still be writing into them: held
        # (pinned) until the call ends, so a late write never lands in someone else's KV.
        self._quarantine: dict[str, list[int]] = {}  # engine thread only
        self._attempts = itertools.count()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._background: set[asyncio.Task] = set()
        self._aborted: dict[str, asyncio.Event] = {}  # asyncio side: live Generate streams
        runtime.set_role_hook(self._after_step)
        runtime.set_abort_hook(self.abort)

    # ---- engine thread -------------------------------------------------------------------
    def _after_step(self, engine: LLMEngine) -> bool:
        for result in self.rt.kv.receiver.poll():
            request_id = self._by_transfer.pop(result.request_id, None)
            pending = self._pending.get(request_id) if request_id else None
            if pending is None:
                continue
            if result.status is TransferStatus.COMPLETE:
                pending.kv_landed = True
                self._maybe_start(engine, pending)
            else:
                self._fail(engine, pending, TimeoutError(
                    f"KV for request {request_id} did not arrive: {result.status.name.lower()}"
                    f" after {result.elapsed_s:.1f}s ({result.num_blocks} blocks landed) {result.error}"
                ) if result.status is TransferStatus.TIMEOUT else Unavailable(
                    f"KV transfer for request {request_id} failed: {result.status.name.lower()} {result.error}"))
        return bool(self._pending)

    def _start_remote(
        self, engine: LLMEngine, request: Request, done: asyncio.Future
    ) -> tuple[str, list[int]] | None:
        """Park the request and expect its KV; (transfer id, block ids to fill) or None."""
        block_ids = engine.add_remote_prefill_request(request)
        if block_ids is None:
            return None
        transfer_id = f"{request.request_id}:{next(self._attempts)}"
        deadline = time.monotonic() + self.rt.config.kv_timeout_s
        try:
            self.rt.kv.receiver.expect(transfer_id, block_ids, deadline=deadline)
        except Exception:
            engine.abort_request(request.request_id)
            raise
        self._pending[request.request_id] = _RemotePrefill(request.request_id, transfer_id, block_ids, done)
        self._by_transfer[transfer_id] = request.request_id
        return transfer_id, block_ids

    def _first_token(self, engine: LLMEngine, request_id: str, token: SampledToken) -> None:
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.first_token = token
            self._maybe_start(engine, pending)

    def _maybe_start(self, engine: LLMEngine, pending: _RemotePrefill) -> None:
        if not (pending.kv_landed and pending.first_token is not None):
            return
        del self._pending[pending.request_id]
        deltas = engine.finish_remote_prefill(pending.request_id, pending.first_token)
        self.rt.deliver(deltas)
        self.rt.settle(pending.done)

    def _fail(self, engine: LLMEngine, pending: _RemotePrefill, exc: Exception) -> None:
        self._pending.pop(pending.request_id, None)
        self._by_transfer.pop(pending.transfer_id, None)
        self.rt.kv.receiver.cancel(pending.transfer_id)
        if not pending.call_ended:
            engine.block_manager.pin(pending.block_ids)
            self._quarantine[pending.transfer_id] = pending.block_ids
        engine.abort_request(pending.request_id)
        self.rt.settle(pending.done, exc=exc)

    def _call_ended(self, engine: LLMEngine, request_id: str, transfer_id: str) -> None:
        pending = self._pending.get(request_id)
        if pending is not None and pending.transfer_id == transfer_id:
            pending.call_ended = True
        blocks = self._quarantine.pop(transfer_id, None)
        if blocks is not None:
            engine.block_manager.release(blocks)

    def _cancel_remote(self, engine: LLMEngine, request_id: str, exc: Exception) -> None:
        pending = self._pending.get(request_id)
        if pending is not None:
            self._fail(engine, pending, exc)

    # ---- asyncio side ----------------------------------------------------------------------
    @grpc_errors
    async def Generate(self, request: pb.GenerateRequest, context):
        rt = self.rt
        rt.admit(request.request_id)
        params = sampling_from_pb(request.sampling)
        rid = request.request_id
        if rid in rt.streams:
            raise ValueError(f"request_id {rid!r} is already live on this worker")
        engine = rt.engine

        resume = resume_from_pb(request)
        def make_request() -> Request:
            return engine.make_request(rid, list(request.prompt_token_ids), params,
                                       request.cache_salt or None, priority=request.priority,
                                       resume=resume)

        req = make_request()
        engine.limits.check_fits(req.num_tokens)  # invalid input fails before any work
        queue: asyncio.Queue = asyncio.Queue()
        rt.streams[rid] = queue
        aborted = self._aborted[rid] = asyncio.Event()
        rt.inflight += 1
        start = time.monotonic()
        finished: set[int] = set()
        num_tokens = [0] * params.n
        mode = "local"
        remote_cached = 0
        try:
            try:
                if request.HasField("prefill_worker") and req.remote_prefill_ok:
                    mode, remote_cached = await _unless_aborted(
                        self._prefill_remotely(req, request.prefill_worker), aborted)
                if mode == "local_fallback":  # the parked request was dropped: start afresh
                    req = make_request()
                if mode != "remote":
                    await rt.call(lambda e: e.submit(req))
                rt.metrics.count_prefill_mode(mode)
                last = None
                while len(finished) < params.n:
                    delta = await queue.get()
                    if delta is _ABORT:
                        raise RequestAborted
                    now = time.monotonic()
                    if last is None:
                        rt.metrics.ttft.labels("decode").observe(now - start)
                    elif delta.token_ids:
                        rt.metrics.itl.labels("decode").observe(now - last)
                    last = now
                    num_tokens[delta.index] += len(delta.token_ids)
                    if delta.finished:
                        finished.add(delta.index)
                    yield delta_to_pb(delta, mode, remote_cached)
            except RequestAborted:
                gone = RequestAborted(f"request {rid} was aborted")
                await asyncio.shield(rt.call(lambda e: (self._cancel_remote(e, rid, gone), e.abort_request(rid))))
                for index in sorted(set(range(params.n)) - finished):
                    finished.add(index)
                    yield delta_to_pb(_abort_delta(req, index, num_tokens[index]), mode, remote_cached)
            rt.metrics.e2e.labels("decode").observe(time.monotonic() - start)
        finally:
            rt.streams.pop(rid, None)
            self._aborted.pop(rid, None)
            rt.inflight -= 1
            if len(finished) < params.n:  # cancelled or failed: free everything now
                gone = Unavailable(f"request {rid} ended before completing (cancelled or failed)")
                await asyncio.shield(rt.call(lambda e: (self._cancel_remote(e, rid, gone), e.abort_request(rid))))

    async def abort(self, request_id: str) -> bool:
        """`Worker.Abort` for a request a Generate stream here owns: that stream ends with a
        final "abort" update (see Generate). False if no stream owns it."""
        aborted = self._aborted.get(request_id)
        if aborted is None or aborted.is_set():
            return False
        aborted.set()
        self.rt.streams[request_id].put_nowait(_ABORT)
        return True

    async def _prefill_remotely(self, req: Request, worker: pb.WorkerRef) -> tuple[str, int]:
        """Run the prompt on prefill worker `worker`. Returns (prefill mode, prompt tokens P
        found cached) once the request is running here; falls back to local prefill."""
        rt = self.rt
        done = rt.aio.create_future()
        started = await rt.call(lambda e: self._start_remote(e, req, done))
        if started is None:
            return "local", 0  # no room for the whole prompt now: let the scheduler queue it
        transfer_id, block_ids = started
        num_skip = rt.engine.limits.blocks_for(req.num_prompt_tokens) - len(block_ids)
        prefill = pb.PrefillRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_to_pb(_for_prefill(req)), cache_salt=req.cache_salt or "",
            priority=req.priority,
            destination=pb.KVDestination(
                peer_metadata=rt.kv_metadata.to_bytes(), num_skip_blocks=num_skip,
                # The prefill side stops writing before we stop waiting.
                block_ids=block_ids, deadline_s=0.9 * rt.config.kv_timeout_s, transfer_id=transfer_id,
            ),
        )
        stub = pb_grpc.PrefillWorkerStub(self._channel(worker.address))
        call = stub.Prefill(prefill, timeout=rt.config.kv_timeout_s)
        try:
            response = await call
        except grpc.aio.AioRpcError as exc:
            await rt.call(lambda e: self._call_ended(e, req.request_id, transfer_id))
            failure = Unavailable(f"prefill worker {worker.worker_id or worker.address} failed: "
                                  f"{exc.code().name}: {exc.details()}")
            await rt.call(lambda e: self._cancel_remote(e, req.request_id, failure))
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED or (
                done.done() and isinstance(done.exception(), TimeoutError)
            ):  # the KV deadline passed: fail clearly rather than start over
                raise TimeoutError(f"KV for request {req.request_id} did not arrive within "
                                   f"{rt.config.kv_timeout_s:g}s") from None
            if rt.config.strict_remote_prefill:
                raise failure
            log.warning("%s; prefilling %s locally", failure, req.request_id)
            return "local_fallback", 0
        except asyncio.CancelledError:
            call.cancel()
            task = rt.aio.create_task(self._abort_remote(worker, req.request_id, transfer_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            raise
        await rt.call(lambda e: self._call_ended(e, req.request_id, transfer_id))
        token = sampled_from_pb(response.first_token, req.sampling.logprobs is not None)
        await rt.call(lambda e: self._first_token(e, req.request_id, token))
        await done  # raises if the KV failed or timed out
        return "remote", response.num_cached_tokens

    async def _abort_remote(self, worker: pb.WorkerRef, request_id: str, transfer_id: str) -> None:
        """After a cancel mid-transfer: abort on the prefill worker, then release our blocks.
        Its Abort returns once its engine thread dropped the request — no write follows. If
        it cannot be reached, the blocks wait out the deadline we gave it instead."""
        rt = self.rt
        grace = 0.9 * rt.config.kv_timeout_s
        try:
            stub = pb_grpc.WorkerStub(self._channel(worker.address))
            await stub.Abort(pb.AbortRequest(request_id=request_id), timeout=grace)
        except grpc.aio.AioRpcError:
            await asyncio.sleep(grace)
        await rt.call(lambda e: self._call_ended(e, request_id, transfer_id))

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return channel


def _for_prefill(req: Request):
    """The prefill worker samples exactly the first token, with this request's seed and the
    same masks a single engine would apply to it (min_tokens > 0 masks EOS and stop ids;
    logit_bias, allowed_token_ids and bad_words as given). Whether that token ends the
    request is decided here, so stop strings stay behind."""
    p = req.sampling
    return replace(p, n=1, max_tokens=1, min_tokens=min(p.min_tokens, 1), stop=(),
                   include_stop_str_in_output=False, prompt_logprobs=None,
                   truncate_prompt_tokens=None, seed=req.seed)


def _abort_delta(req: Request, index: int, num_output_tokens: int) -> CompletionDelta:
    return CompletionDelta(
        request_id=req.request_id, index=index, token_ids=[], text="", logprobs=[],
        finish_reason="abort", num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=max(req.num_cached_tokens, 0), num_output_tokens=num_output_tokens,
    )


async def _unless_aborted(work: Awaitable[T], aborted: asyncio.Event) -> T:
    """`work`'s result, or RequestAborted as soon as `aborted` is set (then `work` is
    cancelled and its cancellation path has run)."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(aborted.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if aborted.is_set():
        if not task.cancelled():
            task.exception()  # retrieved: an abort supersedes whatever the work ended with
        raise RequestAborted
    return task.result()
