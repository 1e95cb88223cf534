"""Per-request sampling settings, validated once at construction."""
from __future__ import annotations

from dataclasses import dataclass


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
    stop: tuple[str, ...] = ()
    """Stop strings; the output text is cut before the first one."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top alternatives per position."""
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        checks = [
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
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise ValueError(f"{name} {message}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
