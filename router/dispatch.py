"""Running one prompt on the cluster: wait for a placement (bounded), call
`DecodeWorker.Generate` on the chosen decode worker (naming the prefill worker, if any), and
stream its updates back as `Delta`s.

Life cycle of a request here:
1. `acquire`: place it; if no decode worker has room, wait for a registry change (capacity
   republished, a request finished) until `queue_timeout_s`, then 503 + Retry-After.
2. Call Generate. This router's in-flight counts on both workers rise until the first token
   (prefill tokens) or the end (decode requests), so back-to-back placements see the load
   before the workers' next capacity report does.
3. A failure before anything was yielded (RPC error, or a completion ending in error/abort
   with no tokens) is retried on other workers, at most `max_retries` times; after that it
   raises `WorkerFailed(after_first_token=...)` for the HTTP layer to turn into a 502 or an
   error event in the stream.
4. Closing the generator early (client disconnect) cancels the gRPC call: the worker aborts.
"""
from __future__ import annotations

import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from cluster.convert import logprob_from_pb, sampling_to_pb, stop_reason_from_pb
from engine.request import Logprob as TokenLogprob
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from router.channels import ChannelPool
from router.config import RouterConfig
from router.errors import APIError
from router.metrics import RouterMetrics
from router.placement import Placement, Placer, PromptKey
from router.policy import Reason
from router.registry import WorkerRegistry, WorkerState

log = logging.getLogger(__name__)

_FAILED = ("error", "abort")


@dataclass(slots=True)
class Delta:
    """One streamed update for one completion of one prompt."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None  # stop | length once this completion ends
    cached_tokens: int  # as reported by the worker (latest value)
    stop_reason: str | int | None = None  # the stop string / token id that ended it; None: EOS
    prompt_logprobs: list[TokenLogprob] | None = None  # first update, when asked for: one per
    # prompt token after the first


def _context_needed(prompt: PromptKey, sampling: SamplingParams) -> int:
    return len(prompt.token_ids) + (sampling.max_tokens or 1)


class WorkerFailed(Exception):
    def __init__(self, message: str, after_first_token: bool) -> None:
        super().__init__(message)
        self.after_first_token = after_first_token


def _delta(msg: pb.GenerateResponse) -> Delta:
    return Delta(
        index=msg.index, token_ids=list(msg.token_ids), text=msg.text,
        logprobs=[logprob_from_pb(lp) for lp in msg.logprobs],
        finish_reason=msg.finish_reason or None, cached_tokens=msg.usage.cached_tokens,
        stop_reason=stop_reason_from_pb(msg),
        prompt_logprobs=[logprob_from_pb(lp) for lp in msg.prompt_logprobs] or None,
    )


class Dispatcher:
    def __init__(self, config: RouterConfig, placer: Placer, channels: ChannelPool,
                 metrics: RouterMetrics) -> None:
        self.config = config
        self.placer = placer
        self.registry = placer.registry
        self.channels = channels
        self.metrics = metrics
        self.num_waiting = 0

    async def acquire(self, prompt: PromptKey, exclude: frozenset[str] = frozenset(),
                      remote_prefill: bool = True, context: int = 0) -> Placement:
        """`context`: the tokens (prompt + output) the decode worker must be able to hold."""
        policy = self.placer.policy.name
        placement = self.placer.place(prompt, exclude, remote_prefill, context)
        if placement is None:
            if self.num_waiting >= self.config.max_queued_requests:
                raise self._busy(policy, "too many requests are waiting for capacity")
            t0 = time.monotonic()
            deadline = t0 + self.config.queue_timeout_s
            self.num_waiting += 1
            self.metrics.waiting.inc()
            try:
                while placement is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise self._busy(policy, "no worker has capacity for this request")
                    await self.registry.wait_changed(min(remaining, 0.25))
                    placement = self.placer.place(prompt, exclude, remote_prefill, context)
            finally:
                self.num_waiting -= 1
                self.metrics.waiting.dec()
                self.metrics.queue_wait.observe(time.monotonic() - t0)
        self.metrics.decisions.labels(policy, placement.decision.reason.value).inc()
        return placement

    def _busy(self, policy: str, message: str) -> APIError:
        self.metrics.decisions.labels(policy, Reason.NO_CAPACITY.value).inc()
        retry_after = str(max(1, round(self.config.queue_timeout_s / 2)))
        return APIError(503, message, code="overloaded", headers={"Retry-After": retry_after})

    async def generate(self, prompt: PromptKey, sampling: SamplingParams,
                       arrival: float, priority: int = 0) -> AsyncIterator[Delta]:
        """Deltas of every completion of one prompt, until each has finished."""
        exclude: set[str] = set()
        for attempt in range(self.config.max_retries + 1):
            # Decode workers prefill n > 1 and prompt-logprobs requests themselves, so those
            # are placed as local prefill.
            placement = await self.acquire(prompt, frozenset(exclude), remote_prefill=sampling.remote_prefill_ok,
                                           context=_context_needed(prompt, sampling))
            try:
                async with aclosing(self._run(placement, prompt, sampling, arrival,
                                              priority)) as stream:
                    async for delta in stream:
                        yield delta
                return
            except WorkerFailed as exc:
                self.metrics.worker_failures.labels(
                    "after_first_token" if exc.after_first_token else "before_first_token").inc()
                if exc.after_first_token or attempt == self.config.max_retries:
                    raise
                log.warning("retrying on another worker: %s", exc)
                self.metrics.retries.inc()
                exclude.add(placement.decode.info.worker_id)
                if placement.prefill is not None:
                    exclude.add(placement.prefill.info.worker_id)

    async def _run(self, placement: Placement, prompt: PromptKey, sampling: SamplingParams,
                   arrival: float, priority: int) -> AsyncIterator[Delta]:
        """One attempt: the Generate call under this router's in-flight accounting, observed
        by the metrics, its failures classified for `generate`."""
        decode = placement.decode
        request = _generate_request(placement, prompt, sampling, priority)
        observer = _CallMetrics(self.metrics, arrival)
        finished: set[int] = set()
        yielded = False
        with _InFlight(placement, len(prompt.token_ids), self.metrics, self.registry) as load:
            try:
                async with aclosing(self._call(decode.info.grpc_address, request)) as messages:
                    async for msg in messages:
                        delta = _delta(msg)
                        if delta.finish_reason in _FAILED:
                            raise _failed_completion(decode, delta, yielded)
                        if delta.token_ids:
                            load.first_token()
                        observer.on_delta(delta)
                        if delta.finish_reason is not None:
                            finished.add(delta.index)
                        yielded = True
                        yield delta
            except grpc.aio.AioRpcError as exc:
                raise _rpc_failure(decode, exc, yielded) from None
            if len(finished) < sampling.n:
                raise _unfinished(decode, sampling.n - len(finished), yielded)
            observer.on_success(len(prompt.token_ids), placement.decision.predicted_cached_tokens)

    async def _call(self, address: str,
                    request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """`DecodeWorker.Generate` at `address`, message by message. Closing this early
        cancels the call: the worker aborts the request."""
        stub = self.channels.hold_decode(address)
        call = None
        try:
            call = stub.Generate(request)
            async for msg in call:
                yield msg
        finally:
            if call is not None:
                call.cancel()  # no-op when the call already ended; aborts it on the worker otherwise
            self.channels.release(address)


def _generate_request(placement: Placement, prompt: PromptKey, sampling: SamplingParams,
                      priority: int) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=f"rt-{uuid.uuid4().hex}", prompt_token_ids=prompt.token_ids,
        sampling=sampling_to_pb(sampling), cache_salt=prompt.cache_salt or "",
        priority=priority,
    )
    if placement.prefill is not None:
        request.prefill_worker.worker_id = placement.prefill.info.worker_id
        request.prefill_worker.address = placement.prefill.info.grpc_address
    return request


class _InFlight:
    """This router's own load on a placement's workers while its call runs, so back-to-back
    placements see it before the workers' next capacity report: the decode worker's request
    count (and the running gauge) until the end; the prefill worker's share of the prompt
    until the first token, or the end if none came. Leaving, however the call ended
    (cancellation included), wakes the requests waiting for capacity."""

    __slots__ = ("decode", "prefill", "prefill_work", "metrics", "registry")

    def __init__(self, placement: Placement, num_prompt: int, metrics: RouterMetrics,
                 registry: WorkerRegistry) -> None:
        self.decode: WorkerState = placement.decode
        self.prefill: WorkerState | None = placement.prefill  # None once its part is done
        # The prefill worker's extra work: the part of the prompt it does not hold.
        self.prefill_work = num_prompt - (
            placement.decision.prefill.cached_tokens if self.prefill is not None else 0)
        self.metrics = metrics
        self.registry = registry

    def __enter__(self) -> _InFlight:
        self.decode.inflight += 1
        if self.prefill is not None:
            self.prefill.inflight_prefill_tokens += self.prefill_work
        self.metrics.running.inc()
        return self

    def first_token(self) -> None:
        """The prefill worker's part is done (later calls do nothing)."""
        if self.prefill is not None:
            self.prefill.inflight_prefill_tokens -= self.prefill_work
            self.prefill = None

    def __exit__(self, *exc_info: object) -> None:
        self.decode.inflight -= 1
        self.first_token()
        self.metrics.running.dec()
        self.registry.notify()


class _CallMetrics:
    """The latency and token metrics of one call. As updates stream: TTFT (the first token
    of any completion, from arrival), ITL (between one completion's tokens), generation
    tokens. Once every completion finished: E2E, prompt tokens, prefix-cache hit tokens (as
    the placement predicted them and as the worker reported them)."""

    __slots__ = ("metrics", "arrival", "last_token_at", "cached")

    def __init__(self, metrics: RouterMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.last_token_at: dict[int, float] = {}  # completion index -> its latest token's time
        self.cached = 0  # prompt tokens the worker found cached (the most it reported)

    def on_delta(self, delta: Delta) -> None:
        self.cached = max(self.cached, delta.cached_tokens)
        if not delta.token_ids:
            return
        now = time.monotonic()
        if not self.last_token_at:
            self.metrics.ttft.observe(now - self.arrival)
        elif delta.index in self.last_token_at:
            self.metrics.itl.observe(now - self.last_token_at[delta.index])
        self.last_token_at[delta.index] = now
        self.metrics.generation_tokens.inc(len(delta.token_ids))

    def on_success(self, num_prompt: int, predicted_cached: int) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        self.metrics.prompt_tokens.inc(num_prompt)
        self.metrics.prefix_hit_tokens.labels("predicted").inc(predicted_cached)
        self.metrics.prefix_hit_tokens.labels("reported").inc(self.cached)


# Failure classification. `yielded`: an update already reached the client (no retry then).

def _failed_completion(decode: WorkerState, delta: Delta, yielded: bool) -> WorkerFailed:
    return WorkerFailed(f"decode worker {decode.info.worker_id}: completion {delta.index} "
                        f"ended with {delta.finish_reason}", yielded)


def _unfinished(decode: WorkerState, missing: int, yielded: bool) -> WorkerFailed:
    return WorkerFailed(f"decode worker {decode.info.worker_id} ended the stream with "
                        f"{missing} completions unfinished", yielded)


def _rpc_failure(decode: WorkerState, exc: grpc.aio.AioRpcError,
                 yielded: bool) -> APIError | WorkerFailed:
    """INVALID_ARGUMENT before any update: the request itself was refused (a 400, not
    retried); anything else: the worker failed."""
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and not yielded:
        return APIError(400, f"rejected by the decode worker: {exc.details()}")
    return WorkerFailed(f"decode worker {decode.info.worker_id} at {decode.info.grpc_address}: "
                        f"{exc.code().name}: {exc.details()}", yielded)
