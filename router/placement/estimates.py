"""How soon each path would produce a prompt's first token, from live queue state and
measured speeds (cluster.registration.Capacity). Pure: snapshots in, seconds out; the only
state is `TTFTCorrection`, fed by the caller with observed TTFTs.

Remote (a prefill worker): its queued prefill tokens + this prompt's uncached tokens there,
over its measured prefill rate. "Uncached" leaves out what the computing worker reuses: its
own hit and blocks it pulls from a peer (router/placement/reuse.py); getting those (promotions from
its second tier, the pull) adds its own time.

Local (the decode worker prefills the prompt itself, chunked beside its running decodes):
one engine step costs `overhead + per_token * tokens` (`StepCost`, a straight line through
the worker's two measured kinds of step: without prompt tokens and with). Each step carries
every running decode plus a chunk of the queued prompts, the chunk limited by the step budget
left after the decodes and by the worker's long-prefill threshold; the prompt's first token
comes when the last chunk of the worker's queue + this prompt is done (`LocalEstimate`). The
same line gives the step time with that chunk, i.e. the inter-token latency the running
decodes would see, which placement holds to its ITL SLO.

Until a decode worker has measured steps of both kinds far enough apart to fit the line, its
per-token cost is the prefill worker's measured rate, then its own (mixed) rate, then the
configured default; its overhead comes from whichever kind of step it measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.registration import Capacity
from cluster.roles import PrefillPath
from engine.core.step_cost import StepCost, fitted_slope, step_cost_from

CORRECTION_WEIGHT = 0.1
"""Weight of the newest observation in a path's TTFT correction."""
CORRECTION_DECAY = 0.98
"""Each observation of one path shrinks the other path's correction by this factor, so an
error learned once is not kept forever by a path that stopped being chosen."""


def step_cost(own: Capacity, peer_rate: float, default_rate: float) -> StepCost:
    """A worker's step cost from its published step timings. `peer_rate`: the measured
    prefill rate of the worker it is compared with (0: unmeasured); `default_rate`: the
    configured rate for when nothing is measured."""
    timings = (
        own.decode_step_s,
        own.decode_step_tokens,
        own.prefill_step_s,
        own.prefill_step_tokens,
    )
    per_token = fitted_slope(*timings)
    if per_token is None:
        per_token = 1.0 / (peer_rate or own.prefill_tokens_per_s or default_rate)
    elif peer_rate:
        # Decode steps of a few rows are memory-bound (flat in tokens), so the line through
        # them understates what a big chunk costs; whole prompts on the peer measured it.
        per_token = max(per_token, 1.0 / peer_rate)
    # Overhead from decode steps first: they are the steps a local prefill's chunks join.
    return step_cost_from(*timings, per_token)


def queue_ttft_s(
    queued_tokens: int, uncached_tokens: int, rate: float, before_s: float = 0.0
) -> float:
    """A prefill worker: its queue, then this prompt, at `rate` tokens/s; `before_s`: what
    this prompt waits for besides (reused KV promoted or pulled first, an adapter loaded)."""
    return (queued_tokens + uncached_tokens) / rate + before_s


@dataclass(frozen=True, slots=True)
class LocalEstimate:
    ttft_s: float
    """Until the prompt's last chunk is computed (its first token is sampled then)."""
    step_s: float
    """One step while chunks of the queue run beside the decodes: their inter-token latency."""
    decode_delay_s: float = 0.0
    """How much later each running decode's stream ends because this prompt's chunks share
    its steps: the prompt's compute time (0 with nothing decoding)."""


def local_prefill(
    own: Capacity, queued_tokens: int, uncached_tokens: int, decoding: int, cost: StepCost
) -> LocalEstimate | None:
    """A decode worker prefilling `uncached_tokens` behind its `queued_tokens`, beside
    `decoding` running decodes (one token each per step). None: the decodes fill its step
    budget, so no prefill chunk fits."""
    work = queued_tokens + uncached_tokens
    if work <= 0:
        return LocalEstimate(0.0, cost.seconds(decoding), 0.0)
    budget = own.max_num_batched_tokens or decoding + work  # unpublished: no limit known
    chunk = min(work, budget - decoding, own.long_prefill_token_threshold or work)
    if chunk <= 0:
        return None
    full_steps, rest = divmod(work, chunk)
    step_s = cost.seconds(decoding + chunk)
    ttft = full_steps * step_s + (cost.seconds(decoding + rest) if rest else 0.0)
    return LocalEstimate(ttft, step_s, cost.per_token_s * uncached_tokens if decoding else 0.0)


PLANNED_PATHS = (PrefillPath.REMOTE, PrefillPath.LOCAL)
"""The paths placement chooses between (`policy.Decision.path`). `LOCAL_FALLBACK` is never a
plan, only what a decode worker reports after the prefill worker it was given failed."""


class TTFTCorrection:
    """What the estimates miss, learned per path: an exponentially weighted mean of
    (observed TTFT - estimated TTFT) over recent requests placed on that path. For the remote
    path that is mostly the hand-off (the KV transfer, the decode worker picking the request
    up); for both, any bias of the step model. The caller observes (the router, at a
    request's first token, timed from its placement); `corrected` adds it (never below 0)."""

    __slots__ = ("_error",)

    def __init__(self) -> None:
        self._error = {path: 0.0 for path in PLANNED_PATHS}

    def error_s(self, path: PrefillPath) -> float:
        return self._error[path]

    def corrected(self, path: PrefillPath, estimate_s: float) -> float:
        return max(0.0, estimate_s + self._error[path])

    def observe(self, path: PrefillPath, estimated_s: float, observed_s: float) -> None:
        self._error[path] += CORRECTION_WEIGHT * (observed_s - estimated_s - self._error[path])
        for other in PLANNED_PATHS:
            if other is not path:
                self._error[other] *= CORRECTION_DECAY
