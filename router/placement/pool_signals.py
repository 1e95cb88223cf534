"""Pool-wide load signals for autoscaling (KEDA ScaledObjects in deploy/k8s/components/keda),
computed from the registry the router places with, so they cover every worker, include this
router's own in-flight work that the workers have not reported yet, and need no per-pod
aggregation in Prometheus."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.roles import Role
from router.placement.registry import WorkerRegistry


@dataclass(frozen=True, slots=True)
class PoolSignals:
    prefill_backlog_s: float
    """Seconds the usable prefill workers need for the prompt tokens queued on them:
    sum of queued tokens / sum of measured prefill rates (a worker not measured yet counts at
    `default_prefill_rate`). 0 without usable prefill workers."""
    decode_kv_usage: float
    """Blocks used / blocks, over the usable decode workers (0 without any)."""
    decode_waiting: int
    """Requests waiting on the usable decode workers (what the routers hold for lack of
    capacity is their own `pdserve_router_waiting_requests`)."""


def pool_signals(registry: WorkerRegistry, default_prefill_rate: float) -> PoolSignals:
    tokens = rate = 0.0
    for w in registry.ready(Role.PREFILL):
        cap = w.info.capacity
        tokens += max(cap.queued_prefill_tokens, w.inflight_prefill_tokens)
        rate += cap.prefill_tokens_per_s or default_prefill_rate
    used = total = 0
    waiting = 0
    for w in registry.ready(Role.DECODE):
        cap = w.info.capacity
        used += cap.total_blocks - cap.free_blocks
        total += cap.total_blocks
        waiting += cap.waiting
    return PoolSignals(tokens / rate if rate > 0 else 0.0, used / total if total else 0.0, waiting)
