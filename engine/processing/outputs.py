"""What the engine hands back: per-step deltas (streaming) and whole results (offline)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.processing.tokens import Logprob


@dataclass(slots=True)
class CompletionDelta:
    """What one engine step produced for one completion of one request."""

    request_id: str  # the caller's id (shared by the n completions)
    index: int  # completion index, 0..n-1
    token_ids: list[int]
    text: str
    logprobs: list[Logprob]
    finish_reason: str | None  # stop | length | abort | error; None while running
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache (or remote KV)
    num_output_tokens: int
    stop_reason: str | int | None = None  # finish "stop": the stop string or token id; None = EOS
    prompt_logprobs: list[Logprob] | None = None
    """Prompt tokens 1.. (token 0 has none); on completion 0's first delta only (n > 1:
    the completions share one prompt)."""
    embedding: list[float] | None = None
    """A pooling request's result, on its one (finishing) delta (engine/sampling/pooling.py)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[Logprob | None] | None = None  # [None, prompt token 1, ...]

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    def add(self, delta: CompletionDelta) -> None:
        out = self.outputs[delta.index]
        out.text += delta.text
        out.token_ids += delta.token_ids
        out.logprobs += delta.logprobs
        out.finish_reason = delta.finish_reason
        out.stop_reason = delta.stop_reason
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = [None, *delta.prompt_logprobs]


@dataclass
class EmbeddingOutput:
    """A pooling request's result (offline API: `LLM.embed`)."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
    num_cached_tokens: int = 0
