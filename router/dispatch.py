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
        d, p = placement.decode, placement.prefill
        request = pb.GenerateRequest(
            request_id=f"rt-{uuid.uuid4().hex}", prompt_token_ids=prompt.token_ids,
            sampling=sampling_to_pb(sampling), cache_salt=prompt.cache_salt or "",
            priority=priority,
        )
        if p is not None:
            request.prefill_worker.worker_id = p.info.worker_id
            request.prefill_worker.address = p.info.grpc_address
        num_prompt = len(prompt.token_ids)
        # The prefill worker's extra work: the part of the prompt it does not hold.
        prefill_work = num_prompt - (placement.decision.prefill.cached_tokens if p else 0)
        d.inflight += 1
        if p is not None:
            p.inflight_prefill_tokens += prefill_work
        self.metrics.running.inc()
        stub = self.channels.hold_decode(d.info.grpc_address)
        call = None
        yielded, cached, last_token_at = False, 0, {}
        finished: set[int] = set()
        try:
            call = stub.Generate(request)
            async for msg in call:
                delta = _delta(msg)
                cached = max(cached, delta.cached_tokens)
                if delta.finish_reason in _FAILED:
                    raise WorkerFailed(f"decode worker {d.info.worker_id}: completion "
                                       f"{delta.index} ended with {delta.finish_reason}", yielded)
                now = time.monotonic()
                if delta.token_ids:
                    if not last_token_at:
                        self.metrics.ttft.observe(now - arrival)
                        if p is not None:
                            p.inflight_prefill_tokens -= prefill_work
                            p = None
                    elif delta.index in last_token_at:
                        self.metrics.itl.observe(now - last_token_at[delta.index])
                    last_token_at[delta.index] = now
                    self.metrics.generation_tokens.inc(len(delta.token_ids))
                if delta.finish_reason is not None:
                    finished.add(delta.index)
                yielded = True
                yield delta
            if len(finished) < sampling.n:
                raise WorkerFailed(f"decode worker {d.info.worker_id} ended the stream with "
                                   f"{sampling.n - len(finished)} completions unfinished", yielded)
            self.metrics.e2e.observe(time.monotonic() - arrival)
            self.metrics.prompt_tokens.inc(num_prompt)
            self.metrics.prefix_hit_tokens.labels("predicted").inc(
                placement.decision.predicted_cached_tokens)
            self.metrics.prefix_hit_tokens.labels("reported").inc(cached)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and not yielded:
                raise APIError(400, f"rejected by the decode worker: {exc.details()}") from None
            raise WorkerFailed(f"decode worker {d.info.worker_id} at {d.info.grpc_address}: "
                               f"{exc.code().name}: {exc.details()}", yielded) from None
        finally:
            if call is not None:
                call.cancel()  # no-op when the call already ended; aborts it on the worker otherwise
            self.channels.release(d.info.grpc_address)
            d.inflight -= 1
            if p is not None:
                p.inflight_prefill_tokens -= prefill_work
            self.metrics.running.dec()
            self.registry.notify()
