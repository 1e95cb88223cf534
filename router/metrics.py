"""The router's Prometheus metrics, in a registry of its own (several routers can live in one
process, as they do in tests)."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from cluster.roles import Role

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _counter(
    name: str, documentation: str, label: str, values: tuple[str, ...], registry: CollectorRegistry
) -> Counter:
    """A counter with one label whose `values` are exported (at 0) from the start."""
    counter = Counter(name, documentation, [label], registry=registry)
    for value in values:
        counter.labels(value)
    return counter


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        # Recent samples for /dashboard's sparklines and decision list (small rings).
        self.recent_ttft: deque[float] = deque(maxlen=120)
        self.recent_itl: deque[float] = deque(maxlen=240)
        self.recent_decisions: deque[dict] = deque(maxlen=20)
        self.requests = Counter(
            "pdserve_router_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "pdserve_router_ttft_seconds",
            "Arrival at the router to the first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_router_itl_seconds",
            "Time between tokens of a completion",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_router_e2e_seconds",
            "Arrival at the router to the last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "pdserve_router_queue_wait_seconds",
            "Wait for a worker with capacity",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "pdserve_router_routing_decisions",
            "Placement decisions by policy and reason",
            ["policy", "reason"],
            registry=r,
        )
        self.kv_pull_decisions = Counter(
            "pdserve_router_kv_pull_decisions",
            "Placements where another worker held more of the prompt than the worker computing "
            "it, by outcome (pull: pull those blocks first; recompute: computing them was "
            "estimated faster)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("pull", "recompute"):
            self.kv_pull_decisions.labels(outcome)
        self.retries = Counter(
            "pdserve_router_retries", "Requests retried on another worker", registry=r
        )
        self.migrations = Counter(
            "pdserve_router_migrations",
            "Requests moved to another decode worker after tokens were "
            "streamed, by what ended the call",
            ["reason"],
            registry=r,
        )
        self.migration_failures = Counter(
            "pdserve_router_migration_failures",
            "Requests ended with an error event after tokens were streamed, by why they could "
            "not move on (limit: --max-migrations used up; n: n > 1; no_worker: none had room)",
            ["reason"],
            registry=r,
        )
        self.migration_seam = Histogram(
            "pdserve_router_migration_seam_seconds",
            "A migration's added latency: failure detected to the next worker's first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.worker_failures = Counter(
            "pdserve_router_worker_failures",
            "Worker calls that failed, by phase",
            ["phase"],
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "pdserve_router_prefix_hit_tokens",
            "Prompt tokens found cached: predicted by the KV index vs reported by the worker",
            ["source"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve_router_prompt_tokens", "Prompt tokens routed", registry=r
        )
        self.generation_tokens = Counter(
            "pdserve_router_generation_tokens", "Tokens generated", registry=r
        )
        self.embedding_placements = Counter(
            "pdserve_router_embedding_placements",
            "Embedding inputs sent to a worker, by the worker's role (prefill only, by design)",
            ["role"],
            registry=r,
        )
        for role in Role:
            self.embedding_placements.labels(role)
        self.rate_limited = _counter(
            "pdserve_router_rate_limited_requests",
            "Requests refused with 429 by the per-API-key limits, by reason (concurrency: "
            "--max-concurrent-requests-per-key; tokens: --max-tokens-per-minute-per-key; "
            "compile_seconds: --max-compile-seconds-per-minute-per-key)",
            "reason",
            ("concurrency", "tokens", "compile_seconds"),
            r,
        )
        self.tool_requests = Counter(
            "pdserve_router_tool_requests",
            "Chat requests that declared tools, by tool_choice (function: a named function)",
            ["tool_choice"],
            registry=r,
        )
        self.tool_calls = Counter(
            "pdserve_router_tool_calls",
            "Tool calls returned to clients, by tool_choice",
            ["tool_choice"],
            registry=r,
        )
        self.reasoning_requests = Counter(
            "pdserve_router_reasoning_requests",
            "Chat requests whose output the reasoning parser split",
            registry=r,
        )
        for choice in ("none", "auto", "required", "function"):
            self.tool_requests.labels(choice)
            self.tool_calls.labels(choice)
        self.waiting = Gauge(
            "pdserve_router_waiting_requests", "Requests waiting for capacity", registry=r
        )
        self.running = Gauge("pdserve_router_running_requests", "Requests on workers", registry=r)
        self.workers = Gauge(
            "pdserve_router_workers",
            "Registered workers by role and state",
            ["role", "state"],
            registry=r,
        )
        self.workers_refused = Gauge(
            "pdserve_router_workers_refused",
            "Registrations ignored now, by reason (block_hash_mismatch: the worker hashes blocks "
            "differently from this router; model: another model; address: outside "
            "--allowed-worker-cidrs)",
            ["reason"],
            registry=r,
        )
        self.placement_hints = _counter(
            "pdserve_router_placement_hints",
            "Requests that carried the endpoint picker's placement, by outcome (followed; "
            "overridden: those workers could not take it any more; unsealed: not the picker's "
            "— no seal, a forged or a stale one — and ignored)",
            "outcome",
            ("followed", "overridden", "unsealed"),
            r,
        )
        self.endpoint_picks = _counter(
            "pdserve_router_endpoint_picks",
            "Endpoint picker (ext_proc) answers, by outcome (placed: workers chosen; "
            "unplaced: forwarded for the router to place; refused: an immediate 4xx/5xx)",
            "outcome",
            ("placed", "unplaced", "refused"),
            r,
        )
        self.endpoint_pick_seconds = Histogram(
            "pdserve_router_endpoint_pick_seconds",
            "Endpoint picker: the request body complete to the answer (parse, tokenize, place)",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=r,
        )
        # Autoscaling signals (docs/kubernetes.md, "What scales on what"), pool-wide as this
        # router sees the registry: every router exports the same values.
        self.prefill_backlog_seconds = Gauge(
            "pdserve_router_prefill_backlog_seconds",
            "Seconds the usable prefill workers need for the prompt tokens queued on them: "
            "queued prefill tokens / their measured prefill rate, summed over the pool",
            registry=r,
        )
        self.decode_kv_usage = Gauge(
            "pdserve_router_decode_kv_usage",
            "KV pool usage (0..1) of the usable decode workers, blocks used / blocks",
            registry=r,
        )
        self.decode_waiting = Gauge(
            "pdserve_router_decode_waiting_requests",
            "Requests waiting on the usable decode workers (their reports)",
            registry=r,
        )
        self.kv_index_blocks = Gauge(
            "pdserve_router_kv_index_blocks", "Distinct block hashes in the KV index", registry=r
        )

    def note_decision(
        self,
        policy: str,
        reason: str,
        decode: str | None,
        prefill: str | None,
        predicted_cached: int = 0,
    ) -> None:
        self.recent_decisions.append(
            {
                "time": time.time(),
                "policy": policy,
                "reason": reason,
                "decode": decode,
                "prefill": prefill,
                "predicted_cached_tokens": predicted_cached,
            }
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
