"""Per-request sampling settings, validated once at construction. Field names and meanings
follow vLLM's `SamplingParams`."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping

from engine.checks import check_fields
from engine.structured.params import StructuredOutputsParams


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Completions per prompt; they share the prompt's KV blocks (copy-on-write)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1) keeps all."""
    top_p: float = 1.0
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's."""
    seed: int | None = None
    """Randomness is drawn from (seed, completion index, output position): reproducible and
    independent of batch composition and of which worker samples."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """HF-style: >1 discourages tokens already in the prompt or output."""
    max_tokens: int | None = 16
    """None: up to the model's context length."""
    min_tokens: int = 0
    """Until this many tokens are out, EOS and `stop_token_ids` are masked from sampling and
    stop strings do not end the request."""
    stop: tuple[str, ...] = ()
    """Stop strings; the output text is cut before the first one."""
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    """Keep the matched stop string (or the stop token's text) at the end of the output."""
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top alternatives per position."""
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob plus this many top alternatives per position (the
    request then computes its whole prompt: no prefix-cache hits)."""
    skip_special_tokens: bool = True
    logit_bias: Mapping[int, float] | None = None
    """Added to these token ids' logits before anything else (OpenAI: -100..100)."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Only these tokens may be sampled."""
    bad_words: tuple[str, ...] = ()
    """Words never generated: each is tokenized with and without a leading space, and the
    token that would complete one of those sequences is masked."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last k prompt tokens."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (a dict of
    StructuredOutputsParams fields is accepted). See engine.structured."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.logit_bias is not None:
            object.__setattr__(
                self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()}
            )
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(
                self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs)
            )
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        check_fields(
            self,
            [
                (self.n >= 1, "n", "must be >= 1"),
                (self.temperature >= 0.0, "temperature", "must be >= 0"),
                (self.top_k >= 0, "top_k", "must be >= 0 (or -1 to disable)"),
                (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
                (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
                (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
                (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
                (self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0"),
                (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1"),
                (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
                (
                    self.max_tokens is None or self.min_tokens <= self.max_tokens,
                    "min_tokens",
                    "must be <= max_tokens",
                ),
                (
                    self.logprobs is None or 0 <= self.logprobs <= 20,
                    "logprobs",
                    "must be in [0, 20]",
                ),
                (
                    self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                    "prompt_logprobs",
                    "must be in [0, 20]",
                ),
                (
                    all(isinstance(s, str) and s for s in self.stop),
                    "stop",
                    "must be non-empty strings",
                ),
                (
                    all(-100.0 <= v <= 100.0 for v in (self.logit_bias or {}).values()),
                    "logit_bias",
                    "values must be in [-100, 100]",
                ),
                (
                    self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
                    "allowed_token_ids",
                    "must not be empty",
                ),
                (
                    all(isinstance(w, str) and w.strip() for w in self.bad_words),
                    "bad_words",
                    "must be non-empty strings",
                ),
                (
                    self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
                    "truncate_prompt_tokens",
                    "must be >= 1",
                ),
            ],
        )

    @property
    def remote_prefill_ok(self) -> bool:
        """A prefill worker returns one first token and no prompt logprobs: requests that need
        more (n > 1, prompt_logprobs) prefill where they decode."""
        return self.n == 1 and self.prompt_logprobs is None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @functools.cached_property
    def plain_draw(self) -> bool:
        """A token that depends on the logits only through their argmax (greedy) or a draw
        from softmax(logits / temperature): no logprobs, penalties, top-k, top-p, min-p,
        logit bias or allowed tokens (the request may still mask: engine/sampling/sampler.py
        `draws_plainly`). Once per request (the sampler asks every step)."""
        return (
            self.logprobs is None
            and not self.has_penalties
            and not self.top_k
            and self.top_p >= 1.0
            and self.min_p <= 0.0
            and not self.logit_bias
            and self.allowed_token_ids is None
        )
