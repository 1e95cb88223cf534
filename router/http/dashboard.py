"""The live cluster page: GET /dashboard (static HTML; its code and styles are
/dashboard/app.js and /dashboard/app.css, no external URLs) polls GET /dashboard/data every
second. The data (per-request routing decisions with their predicted cached tokens among it)
needs the admin key, else the API key, when one is set (router/http/auth.py); the page holds no
data and needs none: it sends the key given in its URL fragment (`/dashboard#key=...`, never
sent to the server) or typed in, kept in the tab's sessionStorage.

The page never executes what it shows (a registration's fields come from etcd, whoever could
write there): the code writes data only as text (router/static/dashboard.js: no innerHTML),
and every part of the page is served with PAGE_HEADERS — a Content-Security-Policy that allows
scripts and styles from this router only (no inline script, no eval, no inline handler, no
frame around it) and `X-Content-Type-Options: nosniff`."""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from typing import Any, Awaitable, Callable, Literal, Union

import httpx
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from cluster.roles import Role
from router.endpoints.base import ResponseModel
from router.http.openapi import route_schema
from router.placement.registry import WorkerState
from router.services import Services

_GENERATE = ("/v1/completions", "/v1/chat/completions")


class DashboardWorker(ResponseModel):
    """One registered worker as /dashboard shows it (from its latest etcd registration)."""

    worker_id: str
    role: Role
    state: Literal["ready", "draining", "stale"]
    address: str
    kv_usage: float  # 1 - free/total blocks (0 when total is unknown)
    total_blocks: int
    free_blocks: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    prefill_tokens_per_s: float
    inflight: int  # this router's requests on it
    kv_bytes: float | None  # KV bytes sent + received so far (its /metrics); None: not scraped


class DashboardDecision(ResponseModel):
    time: float  # unix seconds
    policy: str
    reason: str
    decode: Union[str, None]
    prefill: Union[str, None]
    predicted_cached_tokens: int


class DashboardData(ResponseModel):
    """GET /dashboard/data: what the live cluster page polls. Counters are cumulative (the
    page derives rates between polls); ttft_s / itl_s are the most recent samples."""

    time: float  # unix seconds
    model: str
    workers: list[DashboardWorker]
    requests_total: int  # generation requests answered (completions + chat), any status
    running: int
    waiting: int
    decisions: dict[str, int]  # placement decisions by reason
    prompt_tokens: int
    generation_tokens: int
    prefix_hit_tokens: int  # prompt tokens the workers found cached
    tool_requests: int  # chat requests that declared tools
    tool_calls: int  # tool calls returned
    reasoning_requests: int  # chat requests read with the reasoning parser
    ttft_s: list[float]
    itl_s: list[float]
    recent_decisions: list[DashboardDecision]


CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
"""The page's Content-Security-Policy: its own script and styles, fetches to this router."""
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
"""Headers of every part of the page (the HTML, its script and styles, its data)."""
ASSETS = {
    "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard/app.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/app.css": ("dashboard.css", "text/css; charset=utf-8"),
}
"""path -> (file under router/static/, its media type)."""


def _asset(name: str) -> str:
    return resources.files("router").joinpath(f"static/{name}").read_text("utf-8")


async def kv_bytes_moved(workers: list[WorkerState], timeout_s: float = 0.5) -> dict[str, float]:
    """worker id -> KV bytes it has sent and received so far, from its own /metrics
    (`pdserve_kv_transfer_bytes_total`; the router does not see the transfers). Workers that
    do not answer in time are left out."""

    async def one(http: httpx.AsyncClient, w: WorkerState) -> float | None:
        try:
            text = (await http.get(f"http://{w.info.metrics_address}/metrics")).text
        except httpx.HTTPError:
            return None
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("pdserve_kv_transfer_bytes_total{")
        )

    scraped = [w for w in workers if w.info.metrics_address]
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        values = await asyncio.gather(*(one(http, w) for w in scraped))
    return {w.info.worker_id: v for w, v in zip(scraped, values) if v is not None}


def dashboard_data(services: Services, kv_bytes: dict[str, float]) -> dict[str, Any]:
    registry, metrics = services.registry, services.metrics
    now = registry.clock()
    workers = []
    for w in sorted(registry.all(), key=lambda w: (w.info.role != Role.PREFILL, w.info.worker_id)):
        c = w.info.capacity
        workers.append(
            {
                "worker_id": w.info.worker_id,
                "role": w.info.role,
                "state": registry.state_of(w, now),
                "address": w.info.grpc_address,
                "kv_usage": (1 - c.free_blocks / c.total_blocks) if c.total_blocks else 0.0,
                "total_blocks": c.total_blocks,
                "free_blocks": c.free_blocks,
                "running": c.running,
                "waiting": c.waiting,
                "queued_prefill_tokens": c.queued_prefill_tokens,
                "prefill_tokens_per_s": c.prefill_tokens_per_s,
                "inflight": w.inflight,
                "kv_bytes": kv_bytes.get(w.info.worker_id),
            }
        )
    requests = 0
    by_reason: dict[str, int] = {}
    for family in metrics.requests.collect():
        for s in family.samples:
            if s.name.endswith("_total") and s.labels.get("endpoint") in _GENERATE:
                requests += int(s.value)
    for family in metrics.decisions.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                reason = s.labels["reason"]
                by_reason[reason] = by_reason.get(reason, 0) + int(s.value)

    def value(name: str, **labels: str) -> int:
        return int(metrics.registry.get_sample_value(name, labels) or 0)

    return {
        "time": time.time(),
        "model": services.card.name,
        "workers": workers,
        "requests_total": requests,
        "running": int(metrics.registry.get_sample_value("pdserve_router_running_requests") or 0),
        "waiting": int(metrics.registry.get_sample_value("pdserve_router_waiting_requests") or 0),
        "decisions": by_reason,
        "prompt_tokens": value("pdserve_router_prompt_tokens_total"),
        "generation_tokens": value("pdserve_router_generation_tokens_total"),
        "prefix_hit_tokens": value("pdserve_router_prefix_hit_tokens_total", source="reported"),
        "tool_requests": sum(
            value("pdserve_router_tool_requests_total", tool_choice=c)
            for c in ("none", "auto", "required", "function")
        ),
        "tool_calls": sum(
            value("pdserve_router_tool_calls_total", tool_choice=c)
            for c in ("none", "auto", "required", "function")
        ),
        "reasoning_requests": value("pdserve_router_reasoning_requests_total"),
        "ttft_s": list(metrics.recent_ttft),
        "itl_s": list(metrics.recent_itl),
        "recent_decisions": list(metrics.recent_decisions)[::-1],
    }


def _serving(body: str, media_type: str) -> Callable[[], Awaitable[Response]]:
    """A route answering `body` (a closure: a default argument would be a query parameter)."""

    async def serve() -> Response:
        return Response(body, media_type=media_type, headers=PAGE_HEADERS)

    return serve


def add_page_routes(app: FastAPI) -> None:
    """GET /dashboard and its script and styles (no data: open paths)."""
    for path, (name, media_type) in ASSETS.items():
        body = _asset(name)
        kind = media_type.split(";")[0]

        app.add_api_route(
            path,
            _serving(body, media_type),
            methods=["GET"],
            response_model=None,
            response_class=HTMLResponse if kind == "text/html" else Response,
            responses={
                200: {
                    "description": f"The live cluster page's {name}",
                    "content": {kind: {"schema": {"type": "string"}}},
                }
            },
        )


def add_dashboard_routes(app: FastAPI, services: Services) -> None:
    add_page_routes(app)

    @app.get("/dashboard/data", **route_schema(ok=DashboardData, errors=(401, 403, 500)))
    async def data(response: Response) -> dict[str, Any]:
        response.headers.update(PAGE_HEADERS)
        return dashboard_data(services, await kv_bytes_moved(services.registry.all()))
