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
4. Failures: P unreachable or failing -> the parked request is dropped and the prompt is
   prefilled here (`local_fallback`), or UNAVAILABLE with --strict-remote-prefill; KV not
   complete by the deadline -> DEADLINE_EXCEEDED, nothing decoded from the blocks; the caller
   cancelling -> the request is aborted.
5. `Worker.Abort` (an operator, or a router migrating the request): the stream ends with a
   final "abort" update per unfinished completion; a request whose KV is still on its way is
   dropped like a cancelled one.
Without P (or n > 1, with prompt logprobs, or resumed after a migration) the prompt is
prefilled here (`local`). A worker that serves the prefill role now refuses `Generate`
(FAILED_PRECONDITION; UNAVAILABLE while switching roles: worker_runtime/roles.py).

Steps 2-5 are the state machine of decode_node/remote_prefill.py (PARKED -> KV_LANDED /
FIRST_TOKEN -> RUNNING; a drop -> QUARANTINED -> RELEASED), driven only on the engine thread.
A dropped request's blocks stay quarantined until P confirmed it writes no more: its call
returned, or its `Worker.Abort` answered (`_abort_remote`, retried until it does).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import replace
from typing import Awaitable, TypeVar

import grpc

from cluster.convert import (delta_to_pb, lora_to_pb, request_lora, resume_from_pb,
                             sampled_from_pb, sampling_from_pb, sampling_to_pb)
from decode_node.remote_prefill import RemotePrefills
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionDelta
from engine.request import Request
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from worker_runtime.grpc_errors import Unavailable, grpc_errors
from worker_runtime.runtime import WorkerRuntime

log = logging.getLogger(__name__)
T = TypeVar("T")
_ABORT = object()  # put on a request's stream queue by `abort`
_GONE_AFTER = 3  # UNAVAILABLE answers in a row to an Abort: nothing serves at P's address


class RequestAborted(Exception):
    """`Worker.Abort` was called for a request this worker is streaming."""


class DecodeWorker(pb_grpc.DecodeWorkerServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime
        self.remote = RemotePrefills(runtime.kv.receiver, runtime.settle, runtime.deliver)  # engine thread
        self._attempts = itertools.count()  # transfer ids: one per attempt
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._background: set[asyncio.Task] = set()
        self._aborted: dict[str, asyncio.Event] = {}  # asyncio side: live Generate streams
        runtime.add_step_hook(self._after_step)
        runtime.add_abort_hook(self.abort)

    def _after_step(self, engine: LLMEngine) -> bool:  # engine thread
        self.remote.poll_kv(engine)
        return self.remote.in_flight

    def _drop(self, engine: LLMEngine, request_id: str, exc: Exception) -> None:  # engine thread
        self.remote.fail_request(engine, request_id, exc)
        engine.abort_request(request_id)

    # ---- asyncio side ----------------------------------------------------------------------
    @grpc_errors
    async def Generate(self, request: pb.GenerateRequest, context):
        rt = self.rt
        rt.admit(request.request_id, "decode")
        params = sampling_from_pb(request.sampling)
        rid = request.request_id
        engine = rt.engine

        resume = resume_from_pb(request)
        lora = request_lora(request)

        async def make_request() -> Request:
            args = (rid, list(request.prompt_token_ids), params, request.cache_salt or None,
                    request.priority, resume)
            if params.structured_outputs is None and lora is None:
                return engine.make_request(*args)
            # Compiles its grammar / loads its adapter from disk: off the event loop.
            return await asyncio.to_thread(engine.make_request, *args, lora_request=lora)

        req = await make_request()
        if rid in rt.streams:  # checked after the last await before it is registered below
            raise ValueError(f"request_id {rid!r} is already live on this worker")
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
                    req = await make_request()
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
                await rt.call(lambda e: self._drop(e, rid, gone), cancellable=False)
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
                await rt.call(lambda e: self._drop(e, rid, gone), cancellable=False)

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
        found cached) once the request is running here; falls back to local prefill.
        Every engine command that records what P did is uncancellable (see
        `WorkerRuntime.call`): a cancel at any await below still ends in RUNNING or RELEASED."""
        rt = self.rt
        rid = req.request_id
        done = rt.aio.create_future()
        tid = f"{rid}:{next(self._attempts)}"
        try:
            attempt = await rt.call(lambda e: self.remote.start(e, req, tid, done, rt.config.kv_timeout_s),
                                    cancellable=False)
        except asyncio.CancelledError:  # P was never called: nothing can land, release now
            gone = Unavailable(f"request {rid} was cancelled before its prefill started")
            await rt.call(lambda e: self.remote.writes_stopped(e, tid, gone), cancellable=False)
            raise
        if attempt is None:
            return "local", 0  # no room for the whole prompt now: let the scheduler queue it
        block_ids = attempt.block_ids
        num_skip = rt.engine.limits.blocks_for(req.num_prompt_tokens) - len(block_ids)
        prefill = pb.PrefillRequest(
            request_id=rid, prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_to_pb(_for_prefill(req)), cache_salt=req.cache_salt or "",
            priority=req.priority,
            lora=lora_to_pb(req.lora.request) if req.lora is not None else None,
            destination=pb.KVDestination(
                peer_metadata=rt.kv_metadata.to_bytes(), num_skip_blocks=num_skip,
                # The prefill side stops writing before we stop waiting.
                block_ids=block_ids, deadline_s=0.9 * rt.config.kv_timeout_s, transfer_id=tid,
            ),
        )
        stub = pb_grpc.PrefillWorkerStub(self._channel(worker.address))
        call = stub.Prefill(prefill, timeout=rt.config.kv_timeout_s)
        try:
            response = await call
        except grpc.aio.AioRpcError as exc:
            failure = Unavailable(f"prefill worker {worker.worker_id or worker.address} failed: "
                                  f"{exc.code().name}: {exc.details()}")
            self._confirm_stopped(worker, rid, tid, failure)
            await rt.call(lambda e: self.remote.fail(e, tid, failure), cancellable=False)
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED or (
                done.done() and isinstance(done.exception(), TimeoutError)
            ):  # the KV deadline passed: fail clearly rather than start over
                raise TimeoutError(f"KV for request {rid} did not arrive within "
                                   f"{rt.config.kv_timeout_s:g}s") from None
            if rt.config.strict_remote_prefill:
                raise failure
            log.warning("%s; prefilling %s locally", failure, rid)
            return "local_fallback", 0
        except BaseException:  # cancelled: the caller went away, or Worker.Abort
            call.cancel()
            self._confirm_stopped(worker, rid, tid, Unavailable(f"request {rid} was cancelled"))
            raise
        token = sampled_from_pb(response.first_token, req.sampling.logprobs is not None)
        await rt.call(lambda e: self.remote.first_token(e, tid, token), cancellable=False)
        await done  # raises if the KV failed or timed out
        return "remote", response.num_cached_tokens

    def _confirm_stopped(self, worker: pb.WorkerRef, request_id: str, transfer_id: str,
                         exc: Exception) -> None:
        """In the background: wait until P writes nothing more for this attempt, then
        release its blocks (`RemotePrefills.writes_stopped`)."""
        task = self.rt.aio.create_task(self._abort_remote(worker, request_id, transfer_id, exc))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_remote(self, worker: pb.WorkerRef, request_id: str, transfer_id: str,
                            exc: Exception) -> None:
        """Abort the request on P. P's Abort answers once its sender reported the transfer:
        no write of it can land any more. Retried until P answers; only when nothing serves
        at P's address (UNAVAILABLE, `_GONE_AFTER` times in a row: a dead process writes
        nothing) is P taken as stopped without its word."""
        rt = self.rt
        stub = pb_grpc.WorkerStub(self._channel(worker.address))
        delay, unavailable = 0.05, 0
        while True:
            try:
                await stub.Abort(pb.AbortRequest(request_id=request_id), timeout=rt.config.kv_timeout_s)
                break
            except grpc.aio.AioRpcError as err:
                unavailable = unavailable + 1 if err.code() is grpc.StatusCode.UNAVAILABLE else 0
                if unavailable >= _GONE_AFTER:
                    break
                log.info("abort of %s on %s: %s; retrying", request_id, worker.address, err.code().name)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2.0)
        await rt.call(lambda e: self.remote.writes_stopped(e, transfer_id, exc), cancellable=False)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return channel


def _for_prefill(req: Request):
    """The prefill worker samples exactly the first token, with this request's seed and the
    same masks a single engine would apply to it (min_tokens > 0 masks EOS and stop ids;
    logit_bias, allowed_token_ids, bad_words and the structured-output grammar as given).
    Whether that token ends the request is decided here, so stop strings stay behind."""
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
