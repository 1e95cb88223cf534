"""What one engine step costs as a function of its size: `overhead + per_token * tokens`, a
straight line through two measured kinds of step (without prompt tokens and with). The
router uses it to estimate a decode worker's local prefill (router/placement/estimates.py); the
engine loop uses it to size prompt chunks beside running decodes (`prompt_token_cap`), and
the scheduler cuts a paced prompt into even chunks of at most that size (`even_chunk`)."""

from __future__ import annotations

from dataclasses import dataclass

MIN_FIT_SPREAD_TOKENS = 32.0
"""Prefill and decode steps must differ by this many tokens on average before a slope is
fitted through them (closer, timing noise dominates the slope)."""


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds of one engine step of `tokens` tokens: overhead_s + per_token_s * tokens."""

    overhead_s: float
    per_token_s: float

    def seconds(self, tokens: float) -> float:
        return self.overhead_s + self.per_token_s * tokens


def fitted_slope(
    decode_s: float, decode_tokens: float, prefill_s: float, prefill_tokens: float
) -> float | None:
    """Seconds per token through the two measured step means; None when they are not
    measured or too close to tell a slope from noise."""
    if (
        decode_s > 0
        and prefill_s > decode_s
        and prefill_tokens - decode_tokens >= MIN_FIT_SPREAD_TOKENS
    ):
        return (prefill_s - decode_s) / (prefill_tokens - decode_tokens)
    return None


def step_cost_from(
    decode_s: float,
    decode_tokens: float,
    prefill_s: float,
    prefill_tokens: float,
    per_token_s: float,
) -> StepCost:
    """The line with slope `per_token_s` through the measured decode step (or, not measured,
    the prefill step): its overhead is what that step took beyond its tokens."""
    t, x = (decode_s, decode_tokens) if decode_s > 0 else (prefill_s, prefill_tokens)
    return StepCost(max(0.0, t - per_token_s * x), per_token_s)


MIN_PREFILL_PARTS = 3
"""A paced prompt chunk costs at least this many times the rest of its step: prefill keeps at
least 3/4 of a busy engine's time (one more part per prompt waiting). Every chunk pays its
step's decode part again (the weights stream through once per step), so small chunks make a
prompt slower to prefill: measured on a 2-core AMD EPYC (AVX512-BF16), bf16 SmolLM2, 256
prompt tokens beside one decode: one step 244 ms, two chunks of 128 242 ms, three of 86
291 ms, four of 64 319 ms."""


def prompt_token_cap(
    cost: StepCost, decoding: int, target_s: float, floor: int, budget: int, queued: int = 0
) -> int:
    """Most prompt tokens a step beside `decoding` running decodes may carry to stay within
    `target_s`, at most the step `budget` and at least `floor` and the tokens that take
    (MIN_PREFILL_PARTS + `queued`) times the rest of the step (`queued`: prompts waiting to
    start).

    The second floor gives prefill at least 3/4 of a busy engine's time, 4/5 with one prompt
    queued, 5/6 with two...: prompts are not cut into chunks so small that their decode parts
    slow prefill down, and a backlog drains instead of growing. With the fixed floor alone,
    once the decodes' part of a step neared the target every step carried one block of
    prompt, prompts arrived faster than they were prefilled, more of them decoded, and the
    engine never caught up (measured: TTFT 15-40 s at 0.5-4 req/s on a 2-core host where
    unpaced it was 0.3-1.2 s)."""
    if cost.per_token_s <= 0:
        return budget
    rest = cost.seconds(decoding)
    within_target = int((target_s - rest) / cost.per_token_s)
    keeping_up = int(rest * (MIN_PREFILL_PARTS + queued) / cost.per_token_s)
    return min(budget, max(floor, keeping_up, within_target))


LONG_PREFILL_CHUNKS = 4
"""A running prefill with more than this many paced chunks left is long: while other prompts
wait or prefill, the scheduler gives it half of a step's prompt budget and them the other."""


def even_chunk(num_new_tokens: int, limit: int) -> int:
    """The first of the fewest chunks of at most `limit` tokens (> 0) that `num_new_tokens`
    splits into, all of equal size (give or take a token): 256 tokens at a limit of 150 are
    two chunks of 128, not 150 and 106; at 100, three of 86, not 100, 100 and 56. A step's
    cost grows with its tokens, so even chunks keep the largest step of a prompt (the
    inter-token latency its decodes see) as small as that number of steps allows."""
    pieces = -(-num_new_tokens // limit)
    return -(-num_new_tokens // pieces)
