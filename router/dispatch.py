"""Running one prompt on the cluster: wait for a placement (bounded), call
`DecodeWorker.Generate` on the chosen decode worker (naming the prefill worker, if any), and
stream its updates back as `Delta`s.

Life cycle of a request here:
1. `acquire`: place it; if no decode worker has room, wait for a registry change (capacity
   republished, a request finished) until `queue_timeout_s`, then 503 + Retry-After.
2. Call Generate. This router's in-flight counts on both workers rise until the first token
   (prefill tokens) or the end (decode requests), so back-to-back placements see the load
   before the workers' next capacity report does. The first token's time since placement
   teaches the policy what its TTFT estimate for that path missed (router/placement/estimates.py).
3. A failure before anything was yielded (RPC error, a completion ending in error/abort
   with no tokens, or no token within `first_token_timeout_s`) is retried on other workers,
   at most `max_retries` times; after that it raises `WorkerFailed(after_first_token=False)`
   for the HTTP layer to turn into a 502.
4. Migration: a failure after tokens were yielded (the same failures, or nothing streamed
   for `stall_timeout_s`) re-dispatches the request to another decode worker (never one that
   failed it) as prompt + the tokens yielded so far, with the length of the text yielded: the
   worker prefills them and continues, so the caller's stream goes on without a seam (same
   tokens a seeded request would have drawn; see engine.core.request.Resume). At most
   `max_migrations` times, only for n == 1; otherwise `WorkerFailed(after_first_token=True)`
   (an error event in the stream). A request without a seed gets one drawn here, so a
   migrated unseeded request continues exactly as it would have, too.
5. Closing the generator early (client disconnect) cancels the gRPC call: the worker aborts.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import AsyncGenerator, Callable, TypeVar

import grpc

from cluster.roles import Role
from engine.processing.tokens import Resume
from engine.sampling.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from router.call import (
    CallMetrics,
    Delta,
    FailureReason,
    WorkerFailed,
    delta_from_pb,
    failed_completion,
    generate_request,
    rpc_failure,
    unfinished,
)
from router.channels import ChannelPool
from router.config import RouterConfig
from router.http.errors import APIError
from router.metrics import RouterMetrics
from router.placement.hint import PlacementHint
from router.placement.inflight import InFlight
from router.placement.placer import Placement, Placer, PromptKey
from router.placement.policy import Reason
from router.placement.registry import WorkerState

log = logging.getLogger(__name__)
T = TypeVar("T")
_SEEDS = random.SystemRandom()  # seeds for requests that bring none

_FAILED = ("error", "abort")


# prompt token after the first


def context_needed(prompt: PromptKey, sampling: SamplingParams) -> int:
    return len(prompt.token_ids) + (sampling.max_tokens or 1)


class _CallStalled(Exception):
    """A call streamed nothing within its timeout (`_call`)."""


@dataclass(slots=True)
class _Sent:
    """What one prompt's caller received so far (of completion 0: only n == 1 migrates)."""

    token_ids: list[int] = field(default_factory=list)
    num_text_chars: int = 0
    started: bool = False  # any update yielded: no more retries, only migrations
    cached_tokens: int = 0  # the latest value reported

    def add(self, delta: Delta) -> None:
        self.started = True
        if delta.index == 0:
            self.token_ids += delta.token_ids
            self.num_text_chars += len(delta.text)
            self.cached_tokens = delta.cached_tokens

    def resume(self) -> Resume:
        return Resume(tuple(self.token_ids), self.num_text_chars)


class Dispatcher:
    def __init__(
        self, config: RouterConfig, placer: Placer, channels: ChannelPool, metrics: RouterMetrics
    ) -> None:
        self.config = config
        self.placer = placer
        self.registry = placer.registry
        self.channels = channels
        self.metrics = metrics
        self.num_waiting = 0

    async def acquire(
        self,
        prompt: PromptKey,
        exclude: frozenset[str] = frozenset(),
        remote_prefill: bool = True,
        context: int = 0,
        hint: PlacementHint | None = None,
    ) -> Placement:
        """`context`: the tokens (prompt + output) the decode worker must be able to hold.
        `hint`: the endpoint picker's choice, followed if those workers can take it now
        (router/placement/hint.py)."""
        policy = self.placer.policy.name
        placement = None
        if hint is not None:
            placement = self.placer.place(
                prompt, exclude | hint.exclusion(self.registry.all()), remote_prefill, context
            )
            self.metrics.placement_hints.labels(
                "followed" if placement is not None else "overridden"
            ).inc()
        if placement is None:
            placement = self.placer.place(prompt, exclude, remote_prefill, context)
        if placement is None:
            placement = await self.wait_for(
                lambda: self.placer.place(prompt, exclude, remote_prefill, context),
                "no worker has capacity for this request",
            )
        self.metrics.decisions.labels(policy, placement.decision.reason.value).inc()
        self.metrics.note_decision(
            policy,
            placement.decision.reason.value,
            placement.decode.info.worker_id,
            placement.prefill.info.worker_id if placement.prefill else None,
            placement.decision.predicted_cached_tokens,
        )
        return placement

    async def acquire_prefill(
        self, prompt: PromptKey, exclude: frozenset[str] = frozenset()
    ) -> WorkerState:
        """A prefill worker for prompt-only work (an embedding): the policy's prefill choice
        (prefix affinity, queued prefill work), waited for as `acquire` waits; 503 at once
        when no prefill worker is registered."""
        if not self.registry.by_role(Role.PREFILL):
            raise APIError(
                503,
                "no prefill worker is registered (embeddings run on the prefill pool only)",
                code="no_prefill_workers",
            )
        worker = self.placer.place_prefill(prompt, exclude)
        if worker is None:
            worker = await self.wait_for(
                lambda: self.placer.place_prefill(prompt, exclude),
                "no prefill worker is available for this request",
            )
        self.metrics.embedding_placements.labels(worker.info.role).inc()
        return worker

    async def wait_for(self, place: Callable[[], T | None], busy: str) -> T:
        """`place()` retried on every registry change (capacity republished, a request
        finished) until it is not None: the one bounded wait for capacity. At most
        `max_queued_requests` wait at once (the waiting gauge, the queue-wait histogram);
        past `queue_timeout_s`, or with the queue full, a 503 + Retry-After (`busy`)."""
        policy = self.placer.policy.name
        if self.num_waiting >= self.config.max_queued_requests:
            raise self._busy(policy, "too many requests are waiting for capacity")
        t0 = time.monotonic()
        deadline = t0 + self.config.queue_timeout_s
        self.num_waiting += 1
        self.metrics.waiting.inc()
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._busy(policy, busy)
                await self.registry.wait_changed(min(remaining, 0.25))
                if (found := place()) is not None:
                    return found
        finally:
            self.num_waiting -= 1
            self.metrics.waiting.dec()
            self.metrics.queue_wait.observe(time.monotonic() - t0)

    def _busy(self, policy: str, message: str) -> APIError:
        self.metrics.decisions.labels(policy, Reason.NO_CAPACITY.value).inc()
        self.metrics.note_decision(policy, Reason.NO_CAPACITY.value, None, None)
        retry_after = str(max(1, round(self.config.queue_timeout_s / 2)))
        return APIError(503, message, code="overloaded", headers={"Retry-After": retry_after})

    async def generate(
        self,
        prompt: PromptKey,
        sampling: SamplingParams,
        arrival: float,
        priority: int = 0,
        hint: PlacementHint | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """Deltas of every completion of one prompt, until each has finished; failures are
        retried or migrated (module docstring, 3 and 4). `hint`: followed on the first attempt
        only."""
        if sampling.seed is None:  # (seed, position) then makes a migration seamless
            sampling = replace(sampling, seed=_SEEDS.getrandbits(63))
        exclude: set[str] = set()
        sent = _Sent()
        retries = migrations = 0
        failed_at: float | None = None  # a migration's failure, until the next token
        while True:
            resume = sent.resume() if sent.started else None
            try:
                # Decode workers prefill n > 1, prompt-logprobs and resumed requests
                # themselves (engine Request.remote_prefill_ok), so those are placed as local.
                placement = await self.acquire(
                    prompt,
                    frozenset(exclude),
                    remote_prefill=sampling.remote_prefill_ok and resume is None,
                    context=context_needed(prompt, sampling),
                    hint=hint if not exclude and resume is None else None,
                )
            except APIError:
                if resume is not None:
                    self.metrics.migration_failures.labels("no_worker").inc()
                raise
            try:
                async with aclosing(
                    self._run(placement, prompt, sampling, arrival, priority, resume)
                ) as stream:
                    async for delta in stream:
                        if failed_at is not None and delta.token_ids:
                            self.metrics.migration_seam.observe(time.monotonic() - failed_at)
                            failed_at = None
                        sent.add(delta)
                        yield delta
                return
            except WorkerFailed as exc:
                self.metrics.worker_failures.labels(
                    "after_first_token" if exc.after_first_token else "before_first_token"
                ).inc()
                exclude.add(placement.decode.info.worker_id)
                if not sent.started:
                    if retries == self.config.max_retries:
                        raise
                    retries += 1
                    log.warning("retrying on another worker (%s): %s", exc.reason.value, exc)
                    self.metrics.retries.inc()
                    if placement.prefill is not None:
                        exclude.add(placement.prefill.info.worker_id)
                    continue
                refused = (
                    "n"
                    if sampling.n > 1
                    else "limit"
                    if migrations == self.config.max_migrations
                    else None
                )
                if refused is not None:
                    self.metrics.migration_failures.labels(refused).inc()
                    raise
                migrations += 1
                failed_at = time.monotonic()
                log.warning(
                    "migrating after %d tokens (%s): %s", len(sent.token_ids), exc.reason.value, exc
                )
                self.metrics.migrations.labels(exc.reason.value).inc()

    async def _run(
        self,
        placement: Placement,
        prompt: PromptKey,
        sampling: SamplingParams,
        arrival: float,
        priority: int,
        resume: Resume | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """One attempt: the Generate call under this router's in-flight accounting, observed
        by the metrics, its failures classified for `generate`. `resume`: a migration."""
        decode = placement.decode
        request = generate_request(placement, prompt, sampling, priority, resume)
        observer = CallMetrics(self.metrics, arrival, resumed=resume is not None)
        finished: set[int] = set()
        yielded = resume is not None  # the caller has updates already: never a 400 now
        # A resumed call's first token is not the request's first: the stall timeout holds.
        first_timeout = (
            self.config.stall_timeout_s if resume is not None else self.config.first_token_timeout_s
        )
        placed_at = time.monotonic()
        estimated_ttft_s = placement.decision.estimated_ttft_s
        learn = resume is None and estimated_ttft_s is not None
        with InFlight(placement, len(prompt.token_ids), self.metrics, self.registry) as load:
            try:
                async with aclosing(
                    self._call(decode.info.grpc_address, request, first_timeout)
                ) as messages:
                    async for msg in messages:
                        delta = delta_from_pb(msg)
                        if delta.finish_reason in _FAILED:
                            raise failed_completion(decode, delta, yielded)
                        if delta.token_ids:
                            load.first_token()
                            if learn and estimated_ttft_s is not None:  # what it missed
                                learn = False
                                self.placer.policy.correction.observe(
                                    placement.decision.path,
                                    estimated_ttft_s,
                                    time.monotonic() - placed_at,
                                )
                        observer.ondelta_from_pb(delta)
                        if delta.finish_reason is not None:
                            finished.add(delta.index)
                        yielded = True
                        yield delta
            except grpc.aio.AioRpcError as exc:
                raise rpc_failure(decode, exc, yielded) from None
            except _CallStalled as exc:
                raise WorkerFailed(
                    f"decode worker {decode.info.worker_id}: {exc}",
                    yielded,
                    FailureReason.STALL_TIMEOUT if yielded else FailureReason.FIRST_TOKEN_TIMEOUT,
                ) from None
            if len(finished) < sampling.n:
                raise unfinished(decode, sampling.n - len(finished), yielded)
            observer.on_success(len(prompt.token_ids), placement.decision.predicted_cached_tokens)

    async def _call(
        self, address: str, request: pb.GenerateRequest, first_timeout: float
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """`DecodeWorker.Generate` at `address`, message by message; `_CallStalled` when the
        first message takes over `first_timeout` s, a later one over `stall_timeout_s` (0:
        no limit; time spent by our consumer does not count). Closing this early cancels the
        call: the worker aborts the request."""
        stub = self.channels.hold_decode(address)
        call = None
        try:
            call = stub.Generate(request)
            messages = aiter(call)
            timeout = first_timeout
            while True:
                try:
                    async with asyncio.timeout(timeout or None):
                        msg = await anext(messages)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise _CallStalled(f"nothing streamed for {timeout:g} s") from None
                yield msg
                timeout = self.config.stall_timeout_s
        finally:
            if call is not None:
                # A no-op when the call already ended; aborts it on the worker otherwise.
                call.cancel()
            self.channels.release(address)
