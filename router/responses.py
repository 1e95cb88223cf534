"""OpenAI response bodies from `Delta`s: whole responses (`Collector`) and SSE chunks
(`ChunkWriter`), for chat and text completions. Choice index = prompt index * n + completion
index (completions accept a batch of prompts)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from engine.tokenizer import Tokenizer
from router.dispatch import Delta, TokenLogprob
from router.validation import Prepared


class TokenText:
    """Token id -> its text (and bytes), for logprobs."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.text = lru_cache(maxsize=65536)(lambda t: tokenizer.decode([t]))

    def chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    text_offset: int = 0  # completions logprobs: where the next token starts in the text


class _Base:
    def __init__(self, prepared: Prepared, tokens: TokenText, request_id: str) -> None:
        self.p = prepared
        self.tokens = tokens
        self.id = request_id
        self.created = int(time.time())
        n = prepared.sampling.n
        self.choices = [_Choice() for _ in range(n * len(prepared.prompts))]
        self.cached = [0] * len(prepared.prompts)

    def choice_index(self, prompt_idx: int, delta: Delta) -> int:
        return prompt_idx * self.p.sampling.n + delta.index

    def _track(self, prompt_idx: int, delta: Delta) -> _Choice:
        c = self.choices[self.choice_index(prompt_idx, delta)]
        c.num_tokens += len(delta.token_ids)
        if delta.finish_reason:
            c.finish_reason = delta.finish_reason
        self.cached[prompt_idx] = max(self.cached[prompt_idx], delta.cached_tokens)
        return c

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(ids) for ids in self.p.prompts)
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached)}}

    def chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        k = self.p.sampling.logprobs or 0
        return {"content": [
            {**self.tokens.chat_entry(lp.token_id, lp.logprob),
             "top_logprobs": [self.tokens.chat_entry(t, v) for t, v in lp.top[:k]]}
            for lp in lps
        ]}

    def completion_logprobs(self, c: _Choice, lps: list[TokenLogprob]) -> dict[str, Any]:
        k = self.p.sampling.logprobs or 0
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for lp in lps:
            text = self.tokens.text(lp.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({self.tokens.text(t): v for t, v in lp.top[:k]})
            out["text_offset"].append(c.text_offset)
            c.text_offset += len(text)
        return out


class Collector(_Base):
    """Accumulates a whole (non-streamed) response."""

    def add(self, prompt_idx: int, delta: Delta) -> None:
        c = self._track(prompt_idx, delta)
        c.text.append(delta.text)
        c.logprobs.extend(delta.logprobs)

    def response(self) -> dict[str, Any]:
        chat = self.p.kind == "chat"
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            if chat:
                lp = self.chat_logprobs(c.logprobs) if self.p.chat_logprobs else None
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                lp = (self.completion_logprobs(c, c.logprobs)
                      if self.p.sampling.logprobs is not None else None)
                choices.append({"index": i, "text": text, "logprobs": lp,
                                "finish_reason": c.finish_reason})
        return {"id": self.id, "object": "chat.completion" if chat else "text_completion",
                "created": self.created, "model": self.p.model, "choices": choices,
                "usage": self.usage()}


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class ChunkWriter(_Base):
    """Turns deltas into SSE chunks (`chat.completion.chunk` / `text_completion`)."""

    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        chat = self.p.kind == "chat"
        body: dict[str, Any] = {"id": self.id,
                                "object": "chat.completion.chunk" if chat else "text_completion",
                                "created": self.created, "model": self.p.model, "choices": choices}
        if self.p.include_usage:
            body["usage"] = None
        return sse(body)

    def opening(self) -> bytes:
        """Chat: one chunk per choice announcing the assistant role (nothing for completions)."""
        if self.p.kind != "chat":
            return b""
        return b"".join(
            self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
            for i in range(len(self.choices))
        )

    def chunk(self, prompt_idx: int, delta: Delta) -> bytes:
        c = self._track(prompt_idx, delta)
        i = self.choice_index(prompt_idx, delta)
        if not delta.text and not delta.logprobs and not delta.finish_reason:
            return b""
        if self.p.kind == "chat":
            lp = self.chat_logprobs(delta.logprobs) if self.p.chat_logprobs else None
            d = {"content": delta.text} if delta.text or not delta.finish_reason else {}
            return self._chunk([{"index": i, "delta": d, "logprobs": lp,
                                 "finish_reason": delta.finish_reason}])
        lp = (self.completion_logprobs(c, delta.logprobs)
              if self.p.sampling.logprobs is not None else None)
        return self._chunk([{"index": i, "text": delta.text, "logprobs": lp,
                             "finish_reason": delta.finish_reason}])

    def closing(self) -> bytes:
        """The usage chunk (when asked for) and the terminator."""
        out = b""
        if self.p.include_usage:
            chat = self.p.kind == "chat"
            out += sse({"id": self.id, "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": self.created, "model": self.p.model, "choices": [],
                        "usage": self.usage()})
        return out + sse("[DONE]")
