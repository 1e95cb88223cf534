"""`speculative_config`, as vLLM spells it: parsed once (from a dict or the JSON of
`--speculative-config`) into one frozen object, checked before any model loads."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from engine.checks import FieldError, check_fields

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    """ngram (prompt lookup: drafts copy what followed the last n tokens' earlier occurrence)
    or draft_model (a smaller model drafts greedily)."""
    num_speculative_tokens: int
    """k: most draft tokens verified per sequence per step (the target computes k + 1)."""
    prompt_lookup_max: int = 5
    """ngram: longest suffix n-gram looked up in the sequence's earlier tokens."""
    prompt_lookup_min: int = 1
    """ngram: shortest suffix n-gram that may match."""
    model: str | None = None
    """draft_model: an HF-format directory or GGUF file with the target's vocabulary, or
    `self:N` (the target's first N layers, its final norm and LM head: layer-skip
    self-speculation, no second model and no second KV cache)."""
    adaptive: bool = True
    """Speculate less for sequences whose drafts are mostly rejected (see
    engine.spec_decode.policy); off: always draft k."""

    def __post_init__(self) -> None:
        check_fields(
            self,
            [
                (self.method in METHODS, "method", f"must be one of {', '.join(METHODS)}"),
                (
                    isinstance(self.num_speculative_tokens, int)
                    and self.num_speculative_tokens >= 1,
                    "num_speculative_tokens",
                    "must be an integer >= 1",
                ),
                (self.prompt_lookup_min >= 1, "prompt_lookup_min", "must be >= 1"),
                (
                    self.prompt_lookup_max >= self.prompt_lookup_min,
                    "prompt_lookup_max",
                    "must be >= prompt_lookup_min",
                ),
                (
                    self.method != "draft_model" or bool(self.model),
                    "model",
                    "must name the draft model (a path, or self:N) for method draft_model",
                ),
                (
                    self.method == "draft_model" or self.model is None,
                    "model",
                    "is only for method draft_model",
                ),
            ],
        )
        if self.self_draft_layers is not None and self.self_draft_layers < 1:
            raise FieldError("model", f"model self:N needs N >= 1, got {self.model!r}")

    @property
    def self_draft_layers(self) -> int | None:
        """N for `model: self:N`; None for a separate draft model (or ngram)."""
        if self.model is None or not self.model.startswith("self:"):
            return None
        try:
            return int(self.model[len("self:") :])
        except ValueError:
            raise FieldError(
                "model", f"model self:N needs an integer N, got {self.model!r}"
            ) from None

    @classmethod
    def parse(
        cls, value: "SpeculativeConfig | dict[str, Any] | str | None"
    ) -> "SpeculativeConfig | None":
        """From a dict (LLM(speculative_config={...})), its JSON text (the CLI flag), an
        instance, or None/empty (no speculation). Unknown keys are errors, not ignored."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise FieldError(
                    "speculative_config", f"speculative_config is not JSON: {e}"
                ) from None
        if not isinstance(value, dict):
            raise FieldError("speculative_config", "speculative_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise FieldError(
                "speculative_config",
                f"speculative_config has unknown keys {unknown}; known: {sorted(known)}",
            )
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise FieldError(required, f"speculative_config needs {required!r}")
        return cls(**value)

    def to_json(self) -> str:
        return json.dumps(
            {
                f.name: getattr(self, f.name)
                for f in fields(self)
                if getattr(self, f.name) != f.default
                or f.name in ("method", "num_speculative_tokens")
            }
        )
