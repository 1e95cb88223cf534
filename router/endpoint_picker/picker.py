"""The endpoint picker's decision (Gateway API Inference Extension): for one HTTP request as
the gateway saw it (path, headers, body), the router endpoint to send it to and the workers
that should run it. The ext_proc protocol around it is router/endpoint_picker/ext_proc.py.

What is picked, and why: pdserve's workers speak gRPC, not HTTP, so the InferencePool's
endpoints are the routers (the OpenAI HTTP face); what the gateway cannot choose — the decode
and prefill workers — travels to the router as a `PlacementHint` in request headers. The
decision is the router's own: the same checks as the HTTP API (API key; the key's limits: a
concurrency slot held for the time of the decision, a token bucket not empty; body, model),
the same tokenization, the same `Placer` over the same registry (etcd) and KV index, so prefix
affinity, load and conditional disaggregation decide exactly as they would in the router.

The endpoint is this router's own (`--endpoint-picker-endpoint`), which then follows the hint
with the in-flight accounting of the process that decided; when the gateway restricts the
choice to a subset without it (metadata `envoy.lb.subset_hint`), one of the subset, chosen by
rendezvous hashing on the decode worker, so one decode worker's requests meet in one router.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from dataclasses import dataclass
from typing import Mapping

from cluster.roles import Role
from router.dispatch import context_needed
from router.generation.prepare import Kind, prepare
from router.http.auth import authorize, effective_salt
from router.http.errors import APIError
from router.http.key_limits import TENANT
from router.http.limits import head_refusal, too_large
from router.placement.hint import PlacementHint
from router.placement.placer import PromptKey
from router.services import Services

GENERATION_PATHS: dict[str, Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
}
"""Paths whose requests are placed here; any other path goes to a router that places it (or
needs no worker)."""


@dataclass(frozen=True, slots=True)
class Pick:
    endpoint: str
    """The router to send the request to, IP:PORT."""
    hint: PlacementHint | None
    """The workers chosen for it; None: the router places it itself (another path, a batch
    of prompts, or no worker with room right now: the router queues it)."""
    reason: str
    """The placement's reason (router/placement/policy.py `Reason`), or why nothing was placed."""


class EndpointPicker:
    def __init__(self, services: Services, endpoint: str) -> None:
        """`endpoint`: this router's HTTP endpoint, IP:PORT, as the gateway reaches it."""
        self.services = services
        self.endpoint = endpoint
        self._turn = itertools.count()

    async def pick(
        self, path: str, headers: Mapping[str, str], body: bytes, subset: list[str] | None = None
    ) -> Pick:
        """Raises `APIError` for what the gateway must answer itself: the router's own 4xx for
        the request (bad key, body, model; an unknown path is left to the router), 503 when
        no decode worker is usable or the subset offered is empty."""
        t0 = time.perf_counter()
        metrics = self.services.metrics
        try:
            if subset is not None and not subset:
                raise APIError(
                    503, "the gateway offered no endpoint to pick from", code="no_endpoint"
                )
            kind = GENERATION_PATHS.get(path.partition("?")[0])
            hint, reason = (
                (None, "not_generation")
                if kind is None
                else (await self._place(kind, path, headers, body))
            )
            pick = Pick(self._endpoint(subset, hint), hint, reason)
        except APIError:
            metrics.endpoint_picks.labels("refused").inc()
            raise
        metrics.endpoint_picks.labels("placed" if pick.hint else "unplaced").inc()
        metrics.endpoint_pick_seconds.observe(time.perf_counter() - t0)
        return pick

    async def _place(
        self, kind: Kind, path: str, headers: Mapping[str, str], body: bytes
    ) -> tuple[PlacementHint | None, str]:
        s = self.services
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        scope = {"type": "http", "path": path.partition("?")[0], "headers": raw}
        denied = authorize(s.keys, scope) or head_refusal(
            headers.get(":method", "POST"), dict(raw), s.config.limits.max_request_body_bytes
        )
        if denied is not None:
            raise denied
        if len(body) > s.config.limits.max_request_body_bytes:  # no Content-Length: chunked
            raise too_large(s.config.limits.max_request_body_bytes)
        # The key's limits, as the HTTP middleware applies them (a 429): a slot for the time
        # of the decision (tokenizing is the router's CPU), no token spent.
        tenant = scope.get(TENANT)  # set by authorize: an inference key's digest
        ticket = s.key_limits.admit(tenant if isinstance(tenant, bytes) else None)
        try:
            return await self._decide(kind, scope, body)
        finally:
            s.key_limits.release(ticket)

    async def _decide(
        self, kind: Kind, scope: dict, body: bytes
    ) -> tuple[PlacementHint | None, str]:
        s = self.services
        prepared = await s.tokenizing(
            len(body),
            prepare,
            kind,
            body,
            s.card,
            s.max_model_len(),
            s.loras.served(),
            s.config.limits,
        )
        if not s.registry.ready(Role.DECODE):
            raise APIError(
                503, "no decode worker is usable", code="overloaded", headers={"Retry-After": "1"}
            )
        if len(prepared.prompts) != 1:
            return None, "batch"
        prompt = PromptKey(
            prepared.prompts[0], effective_salt(scope, prepared.cache_salt), prepared.lora
        )
        placement = s.dispatcher.placer.place(
            prompt,
            remote_prefill=prepared.sampling.remote_prefill_ok,
            context=context_needed(prompt, prepared.sampling),
        )
        if placement is None:
            return None, "no_capacity"
        prefill = placement.prefill.info.worker_id if placement.prefill is not None else None
        return (
            PlacementHint(placement.decode.info.worker_id, prefill),
            placement.decision.reason.value,
        )

    def _endpoint(self, subset: list[str] | None, hint: PlacementHint | None) -> str:
        if subset is None or self.endpoint in subset:
            return self.endpoint
        key = hint.decode if hint is not None else str(next(self._turn))
        return max(subset, key=lambda e: hashlib.sha256(f"{key}|{e}".encode()).digest())
