"""`POST /v1/embeddings`, served by the prefill pool alone: an embedding is prompt-only work
(no token is generated, no KV moves), so it never reaches a decode worker.

Life cycle of a request here:
1. `prepare_embedding`: parse strictly (OpenAI's body + vLLM's extensions), tokenize each
   input, check token ids and lengths against the prefill workers' max_model_len; every
   refusal a 400 naming the field.
2. Per input, concurrently: `Dispatcher.acquire_prefill` (router/dispatch.py) picks a prefill
   worker by prefix affinity (the KV index) and queued prefill work — the policy's prefill
   choice; none usable: the dispatcher's one bounded wait (its queue bound, waiting gauge and
   queue-wait histogram), then 503 (at once when no prefill worker is registered).
3. `PrefillWorker.Embed` on it; the worker batches the prompt with its other prefills and
   returns the pooled, normalized hidden state. A worker failure is retried on another one
   (`max_retries`), then 502; INVALID_ARGUMENT is a 400.
4. One JSON body: OpenAI's shape, `embedding` as floats or base64 (little-endian float32).
A client that leaves cancels the calls; the workers abort the requests.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Literal, Mapping, Sequence

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cluster.roles import Role
from engine.sampling.pooling import PoolingParams
from proto import pdserve_pb2 as pb
from router.call import WorkerFailed
from router.config import LimitsConfig
from router.endpoints.base import parse_json
from router.endpoints.embeddings.protocol import EmbeddingRequest, EmbeddingResponse
from router.generation.inputs import check_count, check_token_ids, encode_text, max_prompt_chars
from router.generation.model_card import ModelCard
from router.generation.prepare import check_model
from router.http.auth import effective_salt
from router.http.errors import APIError, bad_request
from router.http.key_limits import TICKET
from router.http.openapi import GENERATE_ERRORS, route_schema
from router.http.streaming import ClientGone, until_disconnect
from router.placement.placer import PromptKey
from router.placement.registry import WorkerState
from router.services import Services

_INT32 = (-(1 << 31), (1 << 31) - 1)


@dataclass(frozen=True)
class PreparedEmbedding:
    model: str
    prompts: list[list[int]]  # token ids, one entry per input
    pooling: PoolingParams
    encoding_format: Literal["float", "base64"]
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None  # the client's (body) request id


def prepare_embedding(
    body: bytes,
    card: ModelCard,
    limit: int,
    adapters: Mapping[str, str] | None = None,
    limits: LimitsConfig | None = None,
) -> PreparedEmbedding:
    """`limit`: the prefill workers' max_model_len (an input has fewer tokens). `adapters`:
    the LoRA adapters served (embeddings run on the base model only). `limits`: the caps on
    the inputs (default: LimitsConfig's)."""
    limits = limits or LimitsConfig()
    req = parse_json(EmbeddingRequest, body)
    if check_model(req.model, card, adapters) is not None:
        raise bad_request(
            f"Embeddings run on the base model only; {req.model!r} is a LoRA "
            f"adapter (use {card.name!r})",
            "model",
        )
    if req.dimensions is not None:
        raise bad_request(
            f"Model {card.name!r} does not support matryoshka representation: "
            "dimensions cannot be set",
            "dimensions",
        )
    if not _INT32[0] <= req.priority <= _INT32[1]:
        raise bad_request(f"priority must be a 32-bit integer, got {req.priority}", "priority")
    if req.cache_salt is not None and not req.cache_salt:
        raise bad_request("cache_salt must be a non-empty string when given", "cache_salt")
    raw = req.input
    items: list = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not items:
        raise bad_request("input must not be empty", "input")
    check_count(items, limits.max_prompts_per_request, "input", "inputs")
    max_chars = max_prompt_chars(card, limit, limits)
    prompts = []
    for item in items:
        ids = (
            encode_text(card.tokenizer, item, req.add_special_tokens, max_chars, "input")
            if isinstance(item, str)
            else list(item)
        )
        if not ids:
            raise bad_request("input must not contain an empty string or token list", "input")
        check_token_ids(ids, card, "input")
        prompts.append(ids)
    if req.truncate_prompt_tokens is not None:
        keep = limit - 1 if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
        if not 1 <= keep <= limit - 1:
            raise bad_request(
                f"truncate_prompt_tokens must be in [1, {limit - 1}] (or -1), got "
                f"{req.truncate_prompt_tokens}",
                "truncate_prompt_tokens",
            )
        prompts = [ids[-keep:] for ids in prompts]
    for i, ids in enumerate(prompts):
        if len(ids) >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, input {i} "
                f"has {len(ids)} tokens (at most {limit - 1} can be embedded).",
                "input",
                "context_length_exceeded",
            )
    return PreparedEmbedding(
        model=card.name,
        prompts=prompts,
        pooling=PoolingParams(req.pooling_type, True if req.normalize is None else req.normalize),
        encoding_format=req.encoding_format,
        priority=req.priority,
        cache_salt=req.cache_salt,
        request_id=req.request_id,
    )


class Embedder:
    """Runs one input on the prefill pool (module docstring, 2 and 3)."""

    def __init__(self, services: Services) -> None:
        d = self.dispatcher = services.dispatcher
        self.config, self.channels = d.config, d.channels
        self.registry, self.metrics, self.card = d.registry, services.metrics, services.card

    def max_model_len(self) -> int:
        """The longest input (+ 1) a prefill worker holds: the largest published by a ready
        prefill worker (else by any registered one), else the model card's."""
        published = [w for w in self.registry.by_role(Role.PREFILL) if w.info.max_model_len > 0]
        live = [w for w in self.registry.ready(Role.PREFILL) if w.info.max_model_len > 0]
        return (
            max(w.info.max_model_len for w in live or published)
            if published
            else self.card.max_model_len
        )

    async def embed(self, prompt: PromptKey, prepared: PreparedEmbedding) -> pb.EmbedResponse:
        exclude: set[str] = set()
        for attempt in range(self.config.max_retries + 1):
            worker = await self.dispatcher.acquire_prefill(prompt, frozenset(exclude))
            try:
                return await self._call(worker, prompt, prepared)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise APIError(
                        400, f"rejected by the prefill worker: {exc.details()}"
                    ) from None
                self.metrics.worker_failures.labels("before_first_token").inc()
                failure = (
                    f"prefill worker {worker.info.worker_id}: {exc.code().name}: {exc.details()}"
                )
                if attempt == self.config.max_retries:
                    raise WorkerFailed(failure, after_first_token=False) from None
                exclude.add(worker.info.worker_id)
                self.metrics.retries.inc()
        raise AssertionError("unreachable")

    async def _call(
        self, worker: WorkerState, prompt: PromptKey, prepared: PreparedEmbedding
    ) -> pb.EmbedResponse:
        """The Embed call, with its prompt counted as this router's queued prefill work on
        the worker until it returns (placements in between see the load)."""
        request = pb.EmbedRequest(
            request_id=f"emb-{uuid.uuid4().hex}",
            prompt_token_ids=prompt.token_ids,
            pooling_type=prepared.pooling.pooling_type,
            normalize=prepared.pooling.normalize,
            cache_salt=prepared.cache_salt or "",
            priority=prepared.priority,
        )
        address = worker.info.grpc_address
        stub = self.channels.hold_prefill(address)
        work = len(prompt.token_ids)
        worker.inflight_prefill_tokens += work
        try:
            return await stub.Embed(request)
        finally:
            worker.inflight_prefill_tokens -= work
            self.channels.release(address)
            self.registry.notify()


def encode(embedding, encoding_format: str) -> list[float] | str:
    """`base64`: the little-endian float32 bytes, base64 (as OpenAI)."""
    if encoding_format == "float":
        return list(embedding)
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")


def embedding_response(
    prepared: PreparedEmbedding, results: list[pb.EmbedResponse], request_id: str
) -> dict[str, Any]:
    num_tokens = sum(len(ids) for ids in prepared.prompts)
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": prepared.model,
        "data": [
            {
                "object": "embedding",
                "index": i,
                "embedding": encode(r.embedding, prepared.encoding_format),
            }
            for i, r in enumerate(results)
        ],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


async def _all(calls: Sequence[Awaitable[pb.EmbedResponse]]) -> list[pb.EmbedResponse]:
    """Every call's result, in order; the first failure cancels the rest."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


def add_embedding_routes(app: FastAPI, services: Services) -> None:
    embedder = Embedder(services)

    @app.post(
        "/v1/embeddings",
        **route_schema(EmbeddingRequest, EmbeddingResponse, errors=GENERATE_ERRORS),
    )
    async def embeddings(request: Request) -> Response:
        body = await request.body()
        prepared = await services.tokenizing(
            len(body),
            prepare_embedding,
            body,
            services.card,
            embedder.max_model_len(),
            services.loras.served(),
            services.config.limits,
        )
        await services.admin.wait_awake()
        prepared = replace(prepared, cache_salt=effective_salt(request.scope, prepared.cache_salt))
        services.key_limits.reserve(
            request.scope.get(TICKET),  # the key's tokens (per minute)
            sum(map(len, prepared.prompts)),
            0,
        )
        base = request.headers.get("x-request-id") or prepared.request_id or uuid.uuid4().hex
        calls = [
            embedder.embed(PromptKey(ids, prepared.cache_salt), prepared)
            for ids in prepared.prompts
        ]
        try:
            results = await until_disconnect(request, _all(calls))
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(embedding_response(prepared, results, f"embd-{base}"))
