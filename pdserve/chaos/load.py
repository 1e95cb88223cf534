"""Steady streaming load for a chaos run: `concurrency` clients, each sending seeded streamed
completions back to back, every request classified when it ends.

A request is `completed` when its stream ends with [DONE], no error event, finish_reason
"length" and usage == max_tokens (ignore_eos); `cancelled` when this client closed it on
purpose (a random share); `failed` otherwise (5xx, an error event, a cut stream, a short
completion). Connection errors before any response (the router restarting) are retried with
a short backoff and counted, not failed, unless the retries run out. Each (prompt, seed) is
asked more than once over the run: its texts must all be equal — a migrated seeded request
must produce exactly what an undisturbed one does (`diverged` otherwise)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

# Several KV blocks each (16 tokens a block): repeated prompts are prefix-cache hits, on the
# worker that served them before or pulled from it (the KV fabric), and evicted blocks go to a
# worker's second tier when it has one.
PROMPTS = [
    f"Story {i}: once upon a time in a land far away, beyond seven rivers and seven "
    "mountains, where the winters were long and the summers short, there lived an old "
    "miller with three sons, a grey cat and a mill that had not turned for many years"
    for i in range(8)
]


@dataclass
class LoadStats:
    outcomes: Counter = field(default_factory=Counter)  # completed | cancelled | failed
    failures: list[str] = field(default_factory=list)  # a line per failed request
    router_retries: int = 0  # connection errors retried (router down)
    texts: dict[tuple[int, int], set[str]] = field(default_factory=dict)  # (prompt, seed) -> texts
    seams: list[float] = field(default_factory=list)  # longest gap between chunks per request

    @property
    def diverged(self) -> list[tuple[int, int]]:
        return [key for key, texts in self.texts.items() if len(texts) > 1]


class Load:
    def __init__(
        self,
        url: str,
        model: str,
        concurrency: int,
        max_tokens: int,
        cancel_share: float,
        seed: int,
    ) -> None:
        self.url, self.model = url, model
        self.concurrency, self.max_tokens = concurrency, max_tokens
        self.cancel_share = cancel_share
        self.rng = random.Random(seed)
        self.stats = LoadStats()
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> LoadStats:
        async with httpx.AsyncClient(
            base_url=self.url, timeout=httpx.Timeout(120, connect=5)
        ) as http:
            await asyncio.gather(*(self._client(http) for _ in range(self.concurrency)))
        return self.stats

    async def _client(self, http: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            prompt, seed = self.rng.randrange(len(PROMPTS)), self.rng.randrange(4)
            cancel_after = (
                self.rng.randrange(1, self.max_tokens)
                if self.rng.random() < self.cancel_share
                else None
            )
            outcome, detail = await self._one(http, prompt, seed, cancel_after)
            self.stats.outcomes[outcome] += 1
            if outcome == "failed":
                self.stats.failures.append(f"prompt {prompt} seed {seed}: {detail}")

    async def _one(self, http, prompt: int, seed: int, cancel_after: int | None) -> tuple[str, str]:
        body = {
            "model": self.model,
            "prompt": PROMPTS[prompt],
            "max_tokens": self.max_tokens,
            "temperature": 0.8,
            "seed": seed,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        give_up = time.monotonic() + 60.0
        while time.monotonic() < give_up:
            try:
                return await self._stream(http, body, (prompt, seed), cancel_after)
            except httpx.TransportError:  # before any response: the router is (re)starting
                self.stats.router_retries += 1
                await asyncio.sleep(0.2)
        return "failed", "router unreachable for 60 s"

    async def _stream(self, http, body, key, cancel_after) -> tuple[str, str]:
        text, chunks, usage, finish, last, gap = [], 0, None, None, time.monotonic(), 0.0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return "failed", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            try:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    doc = json.loads(data)
                    if "error" in doc:
                        return "failed", f"error event: {doc['error'].get('message')}"
                    now = time.monotonic()
                    gap, last = max(gap, now - last), now
                    for choice in doc.get("choices", []):
                        text.append(choice.get("text", ""))
                        finish = choice.get("finish_reason") or finish
                        chunks += 1
                    usage = doc.get("usage") or usage
                    if cancel_after is not None and chunks >= cancel_after:
                        return "cancelled", ""  # leaving the block closes the connection
                else:
                    return "failed", "stream ended without [DONE]"
            except httpx.TransportError as exc:  # after the response began: the stream broke
                return "failed", f"stream cut: {exc!r}"
        tokens = (usage or {}).get("completion_tokens")
        if finish != "length" or tokens != self.max_tokens:
            return "failed", f"finish_reason {finish!r}, completion_tokens {tokens}"
        self.stats.texts.setdefault(key, set()).add("".join(text))
        self.stats.seams.append(gap)
        return "completed", ""
