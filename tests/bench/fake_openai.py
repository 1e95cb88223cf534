"""`FakeOpenAIServer`: an OpenAI-compatible streaming server with scripted timing, for the
benchmark's tests only. It runs uvicorn on a loopback port in a thread of the test process.

Each request gets an arrival number n (0, 1, 2, ... in the order the server sees them) and a
`Plan` from `plan(n, body)`: how long before the first token, the gaps after it, how many
tokens, or an HTTP / mid-stream error. The server records every arrival (`served`) and the
most streams it had open at once (`max_active`; a stream counts from its arrival until just
before its last event, so the count never exceeds the client's true concurrency)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def prompt_words(body: dict[str, Any]) -> int:
    """The fake's "tokenizer": one token per whitespace-separated word of the prompt."""
    if "messages" in body:
        return sum(len(m["content"].split()) for m in body["messages"])
    return len(body["prompt"].split())


@dataclass(frozen=True)
class Plan:
    ttft_s: float = 0.02
    """Delay before the first token."""
    itl_s: float | tuple[float, ...] = 0.01
    """Delay before each later token: one value, or one per gap (len = tokens - 1)."""
    num_tokens: int | None = None
    """Tokens to stream; None = the request's max_tokens."""
    http_status: int = 200
    """Anything but 200: answer with this status and an OpenAI error body, no stream."""
    error_after: int | None = None
    """Send an error event (then [DONE]) after this many tokens."""
    tokens_per_chunk: int = 1
    usage: bool = True
    """Send the usage chunk when the request asks for it."""

    def gap(self, i: int) -> float:
        return self.itl_s[i] if isinstance(self.itl_s, tuple) else self.itl_s


@dataclass
class Served:
    n: int
    arrival: float
    """time.perf_counter() when the request arrived."""
    body: dict[str, Any]
    plan: Plan


@dataclass
class FakeOpenAIServer:
    plan: Callable[[int, dict[str, Any]], Plan] = lambda n, body: Plan()
    model: str = "fake-model"
    api_key: str | None = None
    served: list[Served] = field(default_factory=list)
    active: int = 0
    max_active: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self._app(), log_level="warning", lifespan="off", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("FakeOpenAIServer did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def _begin(self, body: dict[str, Any]) -> Served:
        with self._lock:
            n = len(self.served)
            s = Served(n, time.perf_counter(), body, self.plan(n, body))
            self.served.append(s)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            return s

    def _finish(self) -> None:
        with self._lock:
            self.active -= 1

    def _app(self) -> FastAPI:
        app = FastAPI()

        def unauthorized(request: Request) -> JSONResponse | None:
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return JSONResponse(
                    {"error": {"message": "bad key", "code": "invalid_api_key"}}, status_code=401
                )
            return None

        @app.get("/v1/models")
        async def models(request: Request):
            return unauthorized(request) or {
                "object": "list",
                "data": [{"id": self.model, "object": "model"}],
            }

        @app.post("/v1/completions")
        async def completions(request: Request):
            return unauthorized(request) or self._respond(await request.json(), chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return unauthorized(request) or self._respond(await request.json(), chat=True)

        return app

    def _respond(self, body: dict[str, Any], chat: bool):
        served = self._begin(body)
        plan = served.plan
        if plan.http_status != 200:
            self._finish()
            return JSONResponse(
                {"error": {"message": f"scripted failure {plan.http_status}", "code": "fake"}},
                status_code=plan.http_status,
            )
        return StreamingResponse(self._stream(body, plan, chat), media_type="text/event-stream")

    async def _stream(self, body: dict[str, Any], plan: Plan, chat: bool):
        total = plan.num_tokens if plan.num_tokens is not None else int(body["max_tokens"])
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(data: Any) -> bytes:
            payload = data if isinstance(data, str) else json.dumps(data)
            return f"data: {payload}\n\n".encode()

        def chunk(text: str) -> bytes:
            choice = (
                {"index": 0, "delta": {"content": text}, "finish_reason": None}
                if chat
                else {"index": 0, "text": text, "finish_reason": None}
            )
            return event({"object": obj, "model": self.model, "choices": [choice]})

        finished = False
        try:
            if chat:
                yield event(
                    {
                        "object": obj,
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
                    }
                )
            await asyncio.sleep(plan.ttft_s)
            sent = 0
            while sent < total:
                if sent:
                    await asyncio.sleep(plan.gap(sent - 1))
                if plan.error_after is not None and sent >= plan.error_after:
                    self._finish()
                    finished = True
                    yield event({"error": {"message": "scripted mid-stream failure"}})
                    yield event("[DONE]")
                    return
                k = min(plan.tokens_per_chunk, total - sent)
                sent += k
                yield chunk(" tok" * k)
            include = (body.get("stream_options") or {}).get("include_usage")
            if include and plan.usage:
                prompt = prompt_words(body)
                yield event(
                    {
                        "object": obj,
                        "choices": [],
                        "usage": {
                            "prompt_tokens": prompt,
                            "completion_tokens": total,
                            "total_tokens": prompt + total,
                        },
                    }
                )
            self._finish()
            finished = True
            yield event("[DONE]")
        finally:
            if not finished:
                self._finish()
