"""OpenAI response bodies from `Delta`s: whole responses (`Collector`) and SSE chunks
(`ChunkWriter`), for chat and text completions. Choice index = prompt index * n + completion
index (completions accept a batch of prompts). Every choice carries vLLM's `stop_reason`.
`usage.prompt_tokens_details` (cached tokens) only with --enable-prompt-tokens-details (vLLM's
switch), else null: the count tells whether a prefix was cached, possibly by another client."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from engine.processing.tokens import Logprob
from router.call import Delta, WorkerFailed
from router.generation.logprobs import (
    TextOffsets,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from router.generation.prepare import Prepared
from router.http.errors import APIError
from router.parsers.message import MessageParser
from router.parsers.tools.types import assemble


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    offsets: TextOffsets = field(default_factory=TextOffsets)  # completions: text_offset
    echoed: bool = False  # streamed completions: the prompt went out already
    parser: MessageParser | None = None  # chat with tools / reasoning: reads the text


class _Base:
    def __init__(
        self,
        prepared: Prepared,
        tokens: TokenText,
        request_id: str,
        prompt_tokens_details: bool = False,
    ) -> None:
        self.p = prepared
        self.details = prompt_tokens_details
        self.tokens = tokens
        self.id = request_id
        self.created = int(time.time())
        n = prepared.sampling.n
        output = prepared.output
        self.choices = [
            _Choice(parser=MessageParser(output) if output is not None else None)
            for _ in range(n * len(prepared.prompts))
        ]
        self.cached = [0] * len(prepared.prompts)
        self.prompt_lps: list[list[Logprob] | None] = [None] * len(prepared.prompts)

    @property
    def chat(self) -> bool:
        return self.p.kind == "chat"

    def choice_index(self, prompt_idx: int, delta: Delta) -> int:
        return prompt_idx * self.p.sampling.n + delta.index

    def _track(self, prompt_idx: int, delta: Delta) -> _Choice:
        c = self.choices[self.choice_index(prompt_idx, delta)]
        c.num_tokens += len(delta.token_ids)
        if delta.finish_reason:
            c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
        self.cached[prompt_idx] = max(self.cached[prompt_idx], delta.cached_tokens)
        if delta.prompt_logprobs is not None:
            self.prompt_lps[prompt_idx] = delta.prompt_logprobs
        return c

    def num_tool_calls(self) -> int:
        """Tool calls read from the choices so far."""
        return sum(c.parser.num_calls for c in self.choices if c.parser is not None)

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(ids) for ids in self.p.prompts)
        completion = sum(c.num_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": (
                {"cached_tokens": sum(self.cached)} if self.details else None
            ),
        }

    def _chat_logprobs(self, lps: list[Logprob]) -> dict[str, Any] | None:
        if not self.p.chat_logprobs:
            return None
        return chat_logprobs(self.tokens, lps, self.p.sampling.logprobs or 0, self.p.tokens_as_ids)

    def _completion(
        self, prompt_idx: int, c: _Choice, text: str, lps: list[Logprob]
    ) -> tuple[str, dict[str, Any] | None]:
        """A completion choice's text and logprobs for these output tokens; the first time,
        with echo, the prompt (text, and its logprobs: null for its first token) comes first."""
        k, as_id = self.p.sampling.logprobs, self.p.tokens_as_ids
        echoed = None
        if self.p.echo is not None and not c.echoed:
            c.echoed = True
            prompt_text = self.p.echo[prompt_idx]
            text = prompt_text + text
            if k is not None:
                ids, plps = self.p.prompts[prompt_idx], self.prompt_lps[prompt_idx] or []
                entries = [
                    (t, plps[i - 1] if 0 < i <= len(plps) else None) for i, t in enumerate(ids)
                ]
                echoed = completion_logprobs(self.tokens, entries, k, TextOffsets(), False, as_id)
            c.offsets = TextOffsets(len(prompt_text))
        if k is None:
            return text, None
        out = completion_logprobs(
            self.tokens,
            [(lp.token_id, lp) for lp in lps],
            k,
            c.offsets,
            self.p.sampling.skip_special_tokens,
            as_id,
        )
        return text, out if echoed is None else {key: echoed[key] + out[key] for key in out}

    def _prompt_logprobs(self, prompt_idx: int) -> list | None:
        k = self.p.sampling.prompt_logprobs
        return None if k is None else prompt_logprobs(self.tokens, self.prompt_lps[prompt_idx], k)


class Collector(_Base):
    """Accumulates a whole (non-streamed) response."""

    def add(self, prompt_idx: int, delta: Delta) -> None:
        c = self._track(prompt_idx, delta)
        c.text.append(delta.text)
        c.logprobs.extend(delta.logprobs)

    def response(self) -> dict[str, Any]:
        choices = []
        n = self.p.sampling.n
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            if self.chat:
                choices.append(
                    {
                        "index": i,
                        "message": self._message(c, text),
                        "logprobs": self._chat_logprobs(c.logprobs),
                        "finish_reason": _finish_reason(c),
                        "stop_reason": c.stop_reason,
                    }
                )
            else:
                text, lp = self._completion(i // n, c, text, c.logprobs)
                choices.append(
                    {
                        "index": i,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                        "prompt_logprobs": self._prompt_logprobs(i // n),
                    }
                )
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.p.model,
            "choices": choices,
            "usage": self.usage(),
        }
        if self.chat:
            body["prompt_logprobs"] = self._prompt_logprobs(0)
        return body

    def _message(self, c: _Choice, text: str) -> dict[str, Any]:
        if c.parser is None:
            return {"role": "assistant", "content": text}
        parsed = c.parser.feed(text).extend(c.parser.finish())
        calls = assemble(parsed.tool_calls)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": parsed.content or (None if calls else ""),
        }
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        if c.parser.setup.reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = parsed.reasoning or None
        return message


def _finish_reason(c: _Choice) -> str | None:
    return c.finish_reason if c.parser is None else c.parser.finish_reason(c.finish_reason)


def _parsed_delta(parser: MessageParser, delta: Delta) -> dict[str, Any]:
    """A streamed chat delta's fields: answer text, reasoning, pieces of tool calls."""
    parsed = parser.feed(delta.text)
    if delta.finish_reason:
        parsed.extend(parser.finish())
    d: dict[str, Any] = {}
    if parsed.reasoning:
        d["reasoning_content"] = d["reasoning"] = parsed.reasoning
    if parsed.content:
        d["content"] = parsed.content
    if parsed.tool_calls:
        d["tool_calls"] = [piece.to_openai() for piece in parsed.tool_calls]
    return d


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class ChunkWriter(_Base):
    """Turns deltas into SSE chunks (`chat.completion.chunk` / `text_completion`)."""

    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.p.model,
            "choices": choices,
        }
        if self.p.include_usage:
            body["usage"] = self.usage() if self.p.continuous_usage else None
        return sse(body)

    def opening(self) -> bytes:
        """Chat: one chunk per choice announcing the assistant role (nothing for completions)."""
        if not self.chat:
            return b""
        return b"".join(
            self._chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for i in range(len(self.choices))
        )

    def chunk(self, prompt_idx: int, delta: Delta) -> bytes:
        c = self._track(prompt_idx, delta)
        i = self.choice_index(prompt_idx, delta)
        echo_due = self.p.echo is not None and not c.echoed
        if not (delta.text or delta.logprobs or delta.finish_reason or echo_due):
            return b""
        if self.chat:
            if c.parser is None:
                d = {"content": delta.text} if delta.text or not delta.finish_reason else {}
            else:
                d = _parsed_delta(c.parser, delta)
                if not (d or delta.logprobs or delta.finish_reason):
                    return b""  # the parser holds the text back (a call marker may begin)
            return self._chunk(
                [
                    {
                        "index": i,
                        "delta": d,
                        "logprobs": self._chat_logprobs(delta.logprobs),
                        "finish_reason": _finish_reason(c),
                        "stop_reason": delta.stop_reason,
                    }
                ]
            )
        text, lp = self._completion(prompt_idx, c, delta.text, delta.logprobs)
        return self._chunk(
            [
                {
                    "index": i,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": delta.finish_reason,
                    "stop_reason": delta.stop_reason,
                }
            ]
        )

    def failed(self, exc: WorkerFailed | APIError) -> bytes:
        """The end of a stream that failed after its first update: an error event, then
        `[DONE]` (502 for failed workers)."""
        status = exc.status if isinstance(exc, APIError) else 502
        return sse(APIError(status, str(exc), code="worker_failed").body()) + sse("[DONE]")

    def closing(self) -> bytes:
        """The usage chunk (when asked for) and the terminator."""
        out = b""
        if self.p.include_usage:
            out += sse(
                {
                    "id": self.id,
                    "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created,
                    "model": self.p.model,
                    "choices": [],
                    "usage": self.usage(),
                }
            )
        return out + sse("[DONE]")
