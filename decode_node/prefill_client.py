"""The decode worker's side of a remote prefill: call the prefill worker P (its destination
deferred, so P starts on the prompt at once), park the request, send P the parked blocks
(`SetDestination`), and drive the transfer attempt's state machine (remote_prefill.py) with
what P and the KV receiver report, until the request runs here or its blocks are released.
Until P has the block ids it can write nothing here: a request that cannot be parked, or is
cancelled before, only cancels P's call.

Every engine command that records what P did is uncancellable (`DecodeContext.call`): a
cancel at any await here still ends the attempt in RUNNING or RELEASED. A dropped attempt's
blocks stay quarantined until P confirmed it writes no more: its call returned, or its
`Worker.Abort` answered (`_confirm_stopped`, retried until it does).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import replace
from typing import Callable, NamedTuple

import grpc

from cluster.convert import (
    TokenOutOfRange,
    lora_to_pb,
    peer_reply_error,
    sampled_from_pb,
    sampling_to_pb,
)
from cluster.roles import PrefillPath
from decode_node.remote_prefill import RemotePrefills
from engine.core.request import Request
from engine.llm_engine import LLMEngine
from engine.processing.outputs import CompletionDelta
from engine.processing.tokens import SampledToken
from engine.sampling.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from worker_runtime.contexts import DecodeContext
from worker_runtime.grpc_errors import Unavailable
from worker_runtime.peer_calls import PeerChannels, confirm_stopped

log = logging.getLogger(__name__)


class RemoteResult(NamedTuple):
    """How a remote prefill ended, for the request's stream."""

    path: PrefillPath
    """REMOTE: the request runs here with P's KV; LOCAL: it could not be parked (no room for
    the whole prompt now); LOCAL_FALLBACK: P failed and the parked request was dropped."""
    remote_cached_tokens: int = 0
    """Prompt tokens P found in its own prefix cache (REMOTE only)."""
    kv_landed_at: float | None = None
    """`time.monotonic()` when the last of P's KV landed here (REMOTE only), as P's answer
    tells it (its arrival less `answer_delay_s`): the handover to the first token sent is
    measured from it."""
    admitted: asyncio.Future[None] | None = None
    """REMOTE with the first token already announced: settles once the request runs here
    (None), or with the failure that dropped it after the caller got its first token."""


class PrefillClient:
    """Remote prefills of one decode worker (asyncio side; `remote` on the engine thread)."""

    def __init__(self, ctx: DecodeContext) -> None:
        self.ctx = ctx
        self.remote = RemotePrefills(ctx.receiver, ctx.settle, ctx.deliver)
        self._attempts = itertools.count()  # transfer ids: one per attempt
        self._channels = PeerChannels(ctx.auth)
        self._background: set[asyncio.Task[None]] = set()
        ctx.add_step_hook(self._after_step)

    def _after_step(self, engine: LLMEngine) -> bool:  # engine thread
        self.remote.poll_kv(engine)
        return self.remote.in_flight

    def drop(self, engine: LLMEngine, request_id: str, exc: Exception) -> None:  # engine thread
        """Fail the request's live attempt, if any, and abort it in the engine."""
        self.remote.fail_request(engine, request_id, exc)
        engine.abort_request(request_id)

    async def prefill(
        self,
        req: Request,
        worker: pb.WorkerRef,
        source: pb.KVSource | None = None,
        announce: Callable[[CompletionDelta], None] | None = None,
    ) -> RemoteResult:
        """Run the prompt on prefill worker `worker` (which first pulls what `source`
        holds); returns once the request runs here or the prompt must be prefilled locally
        — or, given `announce`, as soon as P's first token is handed to it (the request's
        first delta, before the engine's next step boundary admits it; `admitted` then
        follows the admission). Raises TimeoutError when P went silent for `kv_timeout_s`,
        Unavailable when P failed and --strict-remote-prefill is set."""
        ctx, rid = self.ctx, req.request_id
        done: asyncio.Future[None] = ctx.create_future()
        # Whoever still waits for it raises its failure; one nobody waits for any more (the
        # caller cancelled) is not an error to report.
        done.add_done_callback(_seen)
        tid = f"push:{rid}:{next(self._attempts)}"
        kv_timeout_s = ctx.kv_timeout_s
        stub = pb_grpc.PrefillWorkerStub(self._channels.get(worker.address))
        # P starts on the prompt now; the block ids follow once the request is parked here
        # (an engine step boundary away), so the parking wait is off the critical path.
        # No deadline on the call: a long prompt takes what it takes. The transfer fails
        # after `kv_timeout_s` without a word from P (its keepalives or blocks), and a dead
        # P's channel fails the call (gRPC keepalive).
        call = stub.Prefill(self._prefill_request(req, tid, source))
        try:
            attempt = await ctx.call(
                lambda e: self.remote.start(e, req, tid, done, kv_timeout_s), cancellable=False
            )
        except asyncio.CancelledError:  # P has no destination: it can write nothing here
            call.cancel()
            gone = Unavailable(f"request {rid} was cancelled before its prefill started")
            await ctx.call(lambda e: self.remote.writes_stopped(e, tid, gone), cancellable=False)
            raise
        if attempt is None:  # no room for the whole prompt now: let the scheduler queue it
            call.cancel()  # likewise without a destination
            return RemoteResult(PrefillPath.LOCAL)
        try:
            await stub.SetDestination(
                self._destination(req, tid, attempt.block_ids), timeout=kv_timeout_s
            )
            response = await _answer_or_kv_failure(call, done)
        except grpc.aio.AioRpcError as exc:
            call.cancel()
            return await self._failed(req, worker, tid, done, exc)
        except (TimeoutError, Unavailable) as exc:  # the KV failed while P's call was open
            call.cancel()
            return self._kv_failed(req, worker, tid, exc)
        except BaseException:  # cancelled: the caller went away, or Worker.Abort
            call.cancel()
            self._confirm_stopped(worker, rid, tid, Unavailable(f"request {rid} was cancelled"))
            raise
        try:  # a first token outside the vocabulary is a failed prefill
            token = sampled_from_pb(
                response.first_token, req.sampling.logprobs is not None, ctx.vocab_size
            )
        except TokenOutOfRange as bad:
            return await self._failed(req, worker, tid, done, peer_reply_error(f"first {bad}"))
        delay_s = max(0.0, response.answer_delay_s)  # a peer's figure: never negative (or NaN)
        landed_at = time.monotonic() - delay_s
        ctx.metrics.kv_handover_prefill.observe(delay_s)
        announced = ctx.preview_first(req, token) if announce is not None else None
        if announce is not None and announced is not None:
            # P answers once its writes completed: the token goes out now (the KV has landed),
            # and the engine admits the request at its next step boundary.
            announce(announced)
            admitted = ctx.create_task(self._admit(tid, token, announced, done))
            self._background.add(admitted)
            admitted.add_done_callback(self._admission_ended)
            return RemoteResult(PrefillPath.REMOTE, response.num_cached_tokens, landed_at, admitted)
        await self._admit(tid, token, None, done)
        return RemoteResult(PrefillPath.REMOTE, response.num_cached_tokens, landed_at)

    async def _admit(
        self,
        tid: str,
        token: SampledToken,
        announced: CompletionDelta | None,
        done: asyncio.Future[None],
    ) -> None:
        """Record P's first token in the attempt (the engine admits the request once its KV
        is complete); returns when it runs here, raises what dropped it otherwise."""
        await self.ctx.call(
            lambda e: self.remote.first_token(e, tid, token, announced), cancellable=False
        )
        await done  # raises if the KV failed or timed out

    def _admission_ended(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        _seen(task)  # the stream that owns it reports a failure, if it is still there

    def _prefill_request(
        self, req: Request, transfer_id: str, source: pb.KVSource | None
    ) -> pb.PrefillRequest:
        return pb.PrefillRequest(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_to_pb(_for_prefill(req)),
            cache_salt=req.cache_salt or "",
            priority=req.priority,
            lora=lora_to_pb(req.lora.request) if req.lora is not None else None,
            kv_source=source,
            destination=pb.KVDestination(
                peer_metadata=self.ctx.own_metadata(),
                # The prefill side stops writing before we stop waiting.
                deadline_s=0.9 * self.ctx.kv_timeout_s,
                transfer_id=transfer_id,
                deferred=True,
            ),
        )

    @staticmethod
    def _destination(req: Request, transfer_id: str, block_ids: list[int]) -> pb.KVDestination:
        """The parked request's blocks, for P's SetDestination: each KV group's blocks after
        its skip (the prefix already here), group after group."""
        skips = req.remote_skip_blocks
        assert skips is not None, "set when the request was parked"
        return pb.KVDestination(
            transfer_id=transfer_id,
            num_skip_blocks=min(skips),
            group_skip_blocks=skips,
            block_ids=block_ids,
        )

    async def _failed(
        self,
        req: Request,
        worker: pb.WorkerRef,
        tid: str,
        done: asyncio.Future[None],
        exc: grpc.aio.AioRpcError,
    ) -> RemoteResult:
        """P's call failed: drop the attempt (its blocks wait for P's word), then fail
        clearly if the KV deadline passed, or fall back to local prefill."""
        ctx, rid = self.ctx, req.request_id
        failure = Unavailable(
            f"prefill worker {worker.worker_id or worker.address} failed: "
            f"{exc.code().name}: {exc.details()}"
        )
        self._confirm_stopped(worker, rid, tid, failure)
        await ctx.call(lambda e: self.remote.fail(e, tid, failure), cancellable=False)
        if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED or (
            done.done() and isinstance(done.exception(), TimeoutError)
        ):
            raise TimeoutError(
                f"KV for request {rid} stopped arriving: nothing from the prefill worker "
                f"for {ctx.kv_timeout_s:g}s"
            ) from None
        if ctx.strict_remote_prefill:
            raise failure
        log.warning("%s; prefilling %s locally", failure, rid)
        return RemoteResult(PrefillPath.LOCAL_FALLBACK)

    def _kv_failed(
        self, req: Request, worker: pb.WorkerRef, tid: str, exc: TimeoutError | Unavailable
    ) -> RemoteResult:
        """The receiver failed the attempt (P went silent for `kv_timeout_s`, or a
        notification contradicted what we expect) before P answered: its blocks wait for
        P's word; a timeout fails the request clearly, anything else falls back to local
        prefill as a failed call does."""
        self._confirm_stopped(worker, req.request_id, tid, exc)
        if isinstance(exc, TimeoutError) or self.ctx.strict_remote_prefill:
            raise exc
        log.warning("%s; prefilling %s locally", exc, req.request_id)
        return RemoteResult(PrefillPath.LOCAL_FALLBACK)

    def _confirm_stopped(
        self, worker: pb.WorkerRef, request_id: str, transfer_id: str, exc: Exception
    ) -> None:
        """In the background: wait until P writes nothing more for this attempt, then
        release its blocks (`RemotePrefills.writes_stopped`)."""
        task = self.ctx.create_task(self._abort_remote(worker, request_id, transfer_id, exc))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_remote(
        self, worker: pb.WorkerRef, request_id: str, transfer_id: str, exc: Exception
    ) -> None:
        """Wait for P's word that it writes nothing more for this attempt
        (worker_runtime/peer_calls.py), then release the attempt's blocks."""
        ctx = self.ctx
        await confirm_stopped(self._channels.get(worker.address), request_id, ctx.kv_timeout_s)
        await ctx.call(lambda e: self.remote.writes_stopped(e, transfer_id, exc), cancellable=False)


async def _answer_or_kv_failure(
    call: grpc.aio.UnaryUnaryCall, done: asyncio.Future[None]
) -> pb.PrefillResponse:
    """P's answer — or, if the attempt fails here first (`done` settled with an error: the
    receiver's progress window passed, or a bad notification), that error. `done` never
    succeeds before the answer (RUNNING needs P's first token). The caller cancels `call`."""
    answer = asyncio.ensure_future(call)
    try:
        await asyncio.wait((answer, done), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        answer.cancel()
        raise
    if answer.done():
        return answer.result()
    answer.cancel()
    exc = done.exception()
    assert exc is not None, "the attempt settles without an error only after P's answer"
    raise exc


def _seen(future: asyncio.Future[None]) -> None:
    """Mark a settled future's failure as seen (asyncio logs one nobody retrieved)."""
    if not future.cancelled():
        future.exception()


def _for_prefill(req: Request) -> SamplingParams:
    """The prefill worker samples exactly the first token, with this request's seed and the
    same masks a single engine would apply to it (min_tokens > 0 masks EOS and stop ids;
    logit_bias, allowed_token_ids, bad_words and the structured-output grammar as given).
    Whether that token ends the request is decided here, so stop strings stay behind."""
    p = req.sampling
    return replace(
        p,
        n=1,
        max_tokens=1,
        min_tokens=min(p.min_tokens, 1),
        stop=(),
        include_stop_str_in_output=False,
        prompt_logprobs=None,
        truncate_prompt_tokens=None,
        seed=req.seed,
    )
