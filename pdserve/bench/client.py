"""One streamed OpenAI request -> a `RequestResult`.

Life cycle of a request here: the runner creates its `RequestResult` (start time set) and
awaits `OpenAIClient.stream`, which POSTs with `stream: true` and reads SSE `data:` lines until
`[DONE]`. Every chunk that carries text stamps a chunk time (the first one is the TTFT); a
usage chunk sets the token counts; an `error` event, a non-200 status, a transport error or a
stream that ends without `[DONE]` sets `error`. `end` is set last, on success and on failure;
if the runner cancels the request (run deadline), it sets the error itself."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.bench.config import EndpointConfig
from pdserve.bench.workload import RequestSpec


@dataclass(slots=True)
class RequestResult:
    index: int
    start: float | None = None
    """Seconds from the start of the run to when the request was sent (None: never sent)."""
    chunk_times: list[float] = field(default_factory=list)
    """Seconds from `start` to each chunk that carried text; chunk_times[0] is the TTFT."""
    end: float | None = None
    """Seconds from `start` to the end of the stream (success or failure)."""
    output_tokens: int = 0
    """Completion tokens: the server's usage when reported, else the number of text chunks."""
    prompt_tokens: int = 0
    """Prompt tokens: the server's usage when reported, else the workload's intended length."""
    usage_reported: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive text chunks (one chunk may carry several tokens)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1); None with fewer than two output tokens."""
        if self.end is None or not self.chunk_times or self.output_tokens < 2:
            return None
        return (self.end - self.chunk_times[0]) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class SseEvent:
    done: bool = False
    """The `[DONE]` terminator."""
    text: str = ""
    """Text of every choice in the chunk, concatenated."""
    usage: dict[str, Any] | None = None
    error: str | None = None


def parse_sse_line(line: str, chat: bool) -> SseEvent | None:
    """One line of an SSE body; None for anything that is not a `data:` line (blank lines,
    comments, `event:` fields)."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return SseEvent(done=True)
    try:
        body = json.loads(payload)
    except json.JSONDecodeError:
        return SseEvent(error=f"malformed SSE data: {payload[:200]!r}")
    if not isinstance(body, dict):
        return SseEvent(error=f"unexpected SSE data: {payload[:200]!r}")
    if body.get("error"):
        return SseEvent(error=f"error event: {_message(body['error'])}")
    parts = []
    for choice in body.get("choices") or []:
        piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        if piece:
            parts.append(piece)
    return SseEvent(text="".join(parts), usage=body.get("usage") or None)


def _message(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def fetch_default_model(http: httpx.AsyncClient, cfg: EndpointConfig) -> str:
    """The first model id from GET {url}/v1/models."""
    url = f"{cfg.url.rstrip('/')}/v1/models"
    try:
        resp = await http.get(url, headers=auth_headers(cfg.api_key), timeout=30.0)
    except httpx.HTTPError as exc:
        raise ValueError(f"GET {url}: {type(exc).__name__}: {exc}") from exc
    if resp.status_code != 200:
        raise ValueError(f"GET /v1/models: HTTP {resp.status_code}: {resp.text[:200]}")
    models = resp.json().get("data") or []
    if not models:
        raise ValueError("GET /v1/models listed no models; pass --model")
    return str(models[0]["id"])


class OpenAIClient:
    """Streams benchmark requests to one OpenAI-compatible server."""

    def __init__(self, http: httpx.AsyncClient, cfg: EndpointConfig, model: str) -> None:
        self.http = http
        self.cfg = cfg
        self.model = model
        self.chat = cfg.endpoint == "chat"
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        self.url = cfg.url.rstrip("/") + path
        self.headers = auth_headers(cfg.api_key)

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.chat:
            body["messages"] = spec.chat_messages()
        else:
            body["prompt"] = spec.completion_prompt()
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def stream(self, spec: RequestSpec, result: RequestResult) -> None:
        """Send `spec`, filling `result` (its `start` is set by the caller, just before)."""
        result.prompt_tokens = spec.prompt_len
        t0 = time.perf_counter()
        try:
            async with self.http.stream(
                "POST", self.url, json=self.body(spec), headers=self.headers
            ) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    result.error = f"HTTP {resp.status_code}: {_error_text(text)}"
                    return
                await self._read(resp, result, t0)
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            result.end = time.perf_counter() - t0

    async def _read(self, resp: httpx.Response, result: RequestResult, t0: float) -> None:
        text_chunks = 0
        async for line in resp.aiter_lines():
            event = parse_sse_line(line, self.chat)
            if event is None:
                continue
            if event.done:
                break
            if event.error:
                result.error = event.error
                return
            if event.text:
                result.chunk_times.append(time.perf_counter() - t0)
                text_chunks += 1
            if event.usage:
                result.usage_reported = True
                result.output_tokens = int(event.usage.get("completion_tokens") or 0)
                result.prompt_tokens = int(event.usage.get("prompt_tokens") or 0)
        else:
            result.error = "stream ended without [DONE]"
            return
        if not result.usage_reported:
            result.output_tokens = text_chunks
        if not result.chunk_times:
            result.error = "stream finished without any output text"


def _error_text(body: str) -> str:
    try:
        return _message(json.loads(body).get("error") or body)[:300]
    except (json.JSONDecodeError, AttributeError):
        return body[:300]
