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
   prefilled here (`PrefillPath.LOCAL_FALLBACK`), or UNAVAILABLE with --strict-remote-prefill; KV
   not complete by the deadline -> DEADLINE_EXCEEDED, nothing decoded from the blocks; the caller
   cancelling -> the request is aborted.
5. `Worker.Abort` (an operator, or a router migrating the request): the stream ends with a
   final "abort" update per unfinished completion; a request whose KV is still on its way is
   dropped like a cancelled one.
Without P (or n > 1, with prompt logprobs, or resumed after a migration) the prompt is
prefilled here (`PrefillPath.LOCAL`). A `kv_source` (a peer holding more of the prompt's
leading blocks) is passed to P, or, prefilling here, pulled first (worker_runtime/kv_pull.py;
a failed pull just means computing those blocks). A worker that serves the prefill role now refuses
`Generate` (FAILED_PRECONDITION; UNAVAILABLE while switching roles: worker_runtime/roles.py).

Steps 2-4 are prefill_client.py, over the state machine of remote_prefill.py (PARKED ->
KV_LANDED / FIRST_TOKEN -> RUNNING; a drop -> QUARANTINED -> RELEASED), driven only on the
engine thread. The call is admitted and counted in flight by `Admission` from its first line
to its last (worker_runtime/admission.py).
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from cluster.convert import delta_to_pb, request_lora, resume_from_pb, sampling_from_pb
from cluster.roles import PrefillPath, Role
from decode_node.prefill_client import PrefillClient, RemoteResult
from engine.core.request import Request
from engine.processing.outputs import CompletionDelta
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from worker_runtime.contexts import DecodeContext
from worker_runtime.grpc_errors import Unavailable
from worker_runtime.kv_pull import KVPuller
from worker_runtime.metrics import WorkerMetrics

T = TypeVar("T")
_ABORT = object()  # put on a request's stream queue by `abort`


@dataclass(frozen=True, slots=True)
class _Failed:
    """Put on a request's stream queue when the request failed after its first token went
    out (an admission after an announced first token): the stream ends with `exc`."""

    exc: BaseException


class RequestAborted(Exception):
    """`Worker.Abort` was called for a request this worker is streaming."""


class DecodeWorker(pb_grpc.DecodeWorkerServicer):
    """The `DecodeWorker` service (thin: `from_pb -> engine -> to_pb`; remote prefills are
    `PrefillClient`'s). It sees the worker through `DecodeContext` only."""

    def __init__(self, ctx: DecodeContext, puller: KVPuller) -> None:
        self.ctx = ctx
        self.puller = puller
        self.prefill = PrefillClient(ctx)
        self._live: dict[str, _Live] = {}  # asyncio side: Generate streams, by request id
        ctx.add_abort_hook(self.abort)

    async def Generate(
        self, request: pb.GenerateRequest, context: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        with self.ctx.admitted(Role.DECODE, request.request_id):
            async for response in self._generate(request):
                yield response

    async def _generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        ctx, rid = self.ctx, request.request_id
        new_request = functools.partial(
            ctx.make_request,
            rid,
            list(request.prompt_token_ids),
            sampling_from_pb(request.sampling),
            request.cache_salt,
            request.priority,
            request_lora(request),
            resume_from_pb(request),
        )
        req = await new_request()
        ctx.limits.check_fits(req.num_tokens)  # invalid input fails before any work
        queue = ctx.open_stream(rid)
        aborted = asyncio.Event()
        self._live[rid] = _Live(aborted, queue)
        sent = _Sent(_Started(req, PrefillPath.LOCAL))
        try:
            try:
                sent.started = await _unless_aborted(
                    self._start(req, request, new_request, queue), aborted
                )
                while not sent.done:
                    delta = await queue.get()
                    if delta is _ABORT:
                        raise RequestAborted
                    if isinstance(delta, _Failed):
                        raise delta.exc
                    sent.record(delta, ctx.metrics)
                    yield sent.to_pb(delta)
            except RequestAborted:
                await self._drop(rid, RequestAborted(f"request {rid} was aborted"))
                for delta in sent.abort_unfinished():
                    yield sent.to_pb(delta)
            ctx.metrics.e2e.labels("decode").observe(time.monotonic() - sent.started_at)
        finally:
            ctx.close_stream(rid)
            self._live.pop(rid, None)
            if not sent.done:  # cancelled or failed: free everything now
                await self._drop(
                    rid, Unavailable(f"request {rid} ended before completing (cancelled or failed)")
                )

    async def _start(
        self,
        req: Request,
        request: pb.GenerateRequest,
        new_request: Callable[[], Awaitable[Request]],
        queue: asyncio.Queue[Any],
    ) -> _Started:
        """Get the request running here: its prompt prefilled on the prefill worker named
        (KV pushed into our blocks), or here — after pulling the leading blocks the router
        named a holder of (kv_source) into whichever of the two computes it. A remote
        prefill's first token is put on `queue` as soon as P returns it (the request is
        admitted at the engine's next step boundary; a failure then ends the stream)."""
        source = request.kv_source if request.HasField("kv_source") else None
        result = RemoteResult(PrefillPath.LOCAL)
        if request.HasField("prefill_worker") and req.remote_prefill_ok:
            result = await self.prefill.prefill(
                req, request.prefill_worker, source, announce=queue.put_nowait
            )
            if result.admitted is not None:
                result.admitted.add_done_callback(functools.partial(_end_on_failure, queue))
        if result.path is PrefillPath.LOCAL_FALLBACK:  # the parked request was dropped
            req = await new_request()
        if result.path is not PrefillPath.REMOTE:
            await self.puller.pull(req, source)
            await self.ctx.call(lambda e: e.submit(req))
        self.ctx.metrics.count_prefill_mode(result.path)
        return _Started(req, result.path, result.remote_cached_tokens, result.kv_landed_at)

    async def _drop(self, request_id: str, exc: Exception) -> None:
        await self.ctx.call(lambda e: self.prefill.drop(e, request_id, exc), cancellable=False)

    async def abort(self, request_id: str) -> bool:
        """`Worker.Abort` for a request a Generate stream here owns: that stream ends with a
        final "abort" update (see Generate). False if no stream owns it."""
        live = self._live.get(request_id)
        if live is None or live.aborted.is_set():
            return False
        live.aborted.set()
        live.queue.put_nowait(_ABORT)
        return True


@dataclass(frozen=True, slots=True)
class _Live:
    """A Generate stream here: set `aborted` and wake its `queue` to end it."""

    aborted: asyncio.Event
    queue: asyncio.Queue[Any]


@dataclass(frozen=True, slots=True)
class _Started:
    request: Request
    """The engine request that runs (a fresh one after a fallback to local prefill)."""
    path: PrefillPath
    remote_cached_tokens: int = 0
    kv_landed_at: float | None = None
    """A remote prefill's last KV landed here then (`time.monotonic()`)."""


@dataclass(slots=True)
class _Sent:
    """What one Generate stream has sent: tokens and the end of each completion, and when."""

    started: _Started
    started_at: float = field(default_factory=time.monotonic)
    last_at: float | None = None
    num_tokens: list[int] = field(init=False)
    finished: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.num_tokens = [0] * self.started.request.sampling.n

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.num_tokens)

    def record(self, delta: CompletionDelta, metrics: WorkerMetrics) -> None:
        now = time.monotonic()
        if self.last_at is None:
            metrics.ttft.labels("decode").observe(now - self.started_at)
            if self.started.kv_landed_at is not None:  # the split path's handover
                metrics.kv_handover.observe(now - self.started.kv_landed_at)
        elif delta.token_ids:
            metrics.itl.labels("decode").observe(now - self.last_at)
        self.last_at = now
        self.num_tokens[delta.index] += len(delta.token_ids)
        if delta.finished:
            self.finished.add(delta.index)

    def to_pb(self, delta: CompletionDelta) -> pb.GenerateResponse:
        return delta_to_pb(delta, self.started.path, self.started.remote_cached_tokens)

    def abort_unfinished(self) -> list[CompletionDelta]:
        """A final "abort" update for every completion not finished yet (now finished)."""
        req, out = self.started.request, []
        for index in sorted(set(range(len(self.num_tokens))) - self.finished):
            self.finished.add(index)
            out.append(
                CompletionDelta(
                    request_id=req.request_id,
                    index=index,
                    token_ids=[],
                    text="",
                    logprobs=[],
                    finish_reason="abort",
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                    num_output_tokens=self.num_tokens[index],
                )
            )
        return out


def _end_on_failure(queue: asyncio.Queue[Any], admitted: asyncio.Future[None]) -> None:
    """An admission that failed after the first token went out ends the stream."""
    exc = None if admitted.cancelled() else admitted.exception()
    if exc is not None:
        queue.put_nowait(_Failed(exc))


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
