"""One `DecodeWorker.Generate` call, the pieces around it that router/dispatch.py drives:
the request message (`generate_request`), what it streams back (`Delta`, from each message),
its latency and token metrics (`CallMetrics`), and how a failure is classified
(`WorkerFailed`: before or after the first token; a refused request is a 400 `APIError`).
"""

from __future__ import annotations

import enum
import time
import uuid
from dataclasses import dataclass, replace

import grpc

from cluster.convert import logprob_from_pb, lora_to_pb, sampling_to_pb, stop_reason_from_pb
from engine.processing.tokens import Logprob as TokenLogprob
from engine.processing.tokens import Resume
from engine.sampling.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from router.http.errors import APIError
from router.metrics import RouterMetrics
from router.placement.placer import Placement, PromptKey
from router.placement.registry import WorkerState


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


class FailureReason(str, enum.Enum):
    """What ended a worker call early (the `reason` label of the migration metrics)."""

    ERROR = "error"  # RPC error, a completion ending in error/abort, or the stream cut short
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"
    STALL_TIMEOUT = "stall_timeout"


class WorkerFailed(Exception):
    def __init__(
        self, message: str, after_first_token: bool, reason: FailureReason = FailureReason.ERROR
    ) -> None:
        super().__init__(message)
        self.after_first_token = after_first_token
        self.reason = reason


def delta_from_pb(msg: pb.GenerateResponse) -> Delta:
    return Delta(
        index=msg.index,
        token_ids=list(msg.token_ids),
        text=msg.text,
        logprobs=[logprob_from_pb(lp) for lp in msg.logprobs],
        finish_reason=msg.finish_reason or None,
        cached_tokens=msg.usage.cached_tokens,
        stop_reason=stop_reason_from_pb(msg),
        prompt_logprobs=[logprob_from_pb(lp) for lp in msg.prompt_logprobs] or None,
    )


def generate_request(
    placement: Placement,
    prompt: PromptKey,
    sampling: SamplingParams,
    priority: int,
    resume: Resume | None,
) -> pb.GenerateRequest:
    if resume is not None:  # prompt logprobs came with the first update already
        sampling = replace(sampling, prompt_logprobs=None)
    request = pb.GenerateRequest(
        request_id=f"rt-{uuid.uuid4().hex}",
        prompt_token_ids=prompt.token_ids,
        sampling=sampling_to_pb(sampling),
        cache_salt=prompt.cache_salt or "",
        priority=priority,
    )
    if prompt.lora is not None:
        request.lora.CopyFrom(lora_to_pb(prompt.lora))
    if resume is not None:
        request.resume_output_token_ids.extend(resume.output_token_ids)
        request.resume_text_chars = resume.num_text_chars
    if placement.prefill is not None:
        request.prefill_worker.worker_id = placement.prefill.info.worker_id
        request.prefill_worker.address = placement.prefill.info.grpc_address
    source = placement.kv_source  # relative to the worker that computes the prompt
    if source is not None:
        request.kv_source.worker_id = source.holder.info.worker_id
        request.kv_source.address = source.holder.info.grpc_address
        request.kv_source.num_blocks = source.num_blocks
    return request


class CallMetrics:
    """The latency and token metrics of one call. As updates stream: TTFT (the first token
    of any completion, from arrival), ITL (between one completion's tokens), generation
    tokens. Once every completion finished: E2E, prompt tokens, prefix-cache hit tokens (as
    the placement predicted them and as the worker reported them). A resumed call (a
    migration) has no TTFT; its seam is `migration_seam`, not an ITL."""

    __slots__ = ("metrics", "arrival", "resumed", "last_token_at", "cached")

    def __init__(self, metrics: RouterMetrics, arrival: float, resumed: bool = False) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.resumed = resumed
        self.last_token_at: dict[int, float] = {}  # completion index -> its latest token's time
        self.cached = 0  # prompt tokens the worker found cached (the most it reported)

    def ondelta_from_pb(self, delta: Delta) -> None:
        self.cached = max(self.cached, delta.cached_tokens)
        if not delta.token_ids:
            return
        now = time.monotonic()
        if not self.last_token_at:
            if not self.resumed:
                self.metrics.ttft.observe(now - self.arrival)
                self.metrics.recent_ttft.append(now - self.arrival)
        elif delta.index in self.last_token_at:
            self.metrics.itl.observe(now - self.last_token_at[delta.index])
            self.metrics.recent_itl.append(now - self.last_token_at[delta.index])
        self.last_token_at[delta.index] = now
        self.metrics.generation_tokens.inc(len(delta.token_ids))

    def on_success(self, num_prompt: int, predicted_cached: int) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        self.metrics.prompt_tokens.inc(num_prompt)
        self.metrics.prefix_hit_tokens.labels("predicted").inc(predicted_cached)
        self.metrics.prefix_hit_tokens.labels("reported").inc(self.cached)


# Failure classification. `yielded`: an update already reached the client (no retry then).


def failed_completion(decode: WorkerState, delta: Delta, yielded: bool) -> WorkerFailed:
    return WorkerFailed(
        f"decode worker {decode.info.worker_id}: completion {delta.index} "
        f"ended with {delta.finish_reason}",
        yielded,
    )


def unfinished(decode: WorkerState, missing: int, yielded: bool) -> WorkerFailed:
    return WorkerFailed(
        f"decode worker {decode.info.worker_id} ended the stream with "
        f"{missing} completions unfinished",
        yielded,
    )


def rpc_failure(
    decode: WorkerState, exc: grpc.aio.AioRpcError, yielded: bool
) -> APIError | WorkerFailed:
    """INVALID_ARGUMENT before any update: the request itself was refused (a 400, not
    retried); anything else: the worker failed."""
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and not yielded:
        return APIError(400, f"rejected by the decode worker: {exc.details()}")
    return WorkerFailed(
        f"decode worker {decode.info.worker_id} at {decode.info.grpc_address}: "
        f"{exc.code().name}: {exc.details()}",
        yielded,
    )
