"""The pool-wide autoscaling signals (router/placement/pool_signals.py) the KEDA ScaledObjects read:
prefill backlog in seconds (queued tokens / measured rates, this router's unreported in-flight
work included), decode KV usage and waiting requests, over usable workers only; and their
gauges on /metrics."""

import pytest

from cluster.registration import Capacity, WorkerInfo
from router.placement.pool_signals import pool_signals
from router.placement.registry import WorkerRegistry


def info(wid, role, draining=False, **cap):
    return WorkerInfo(
        wid,
        role,
        f"10.0.0.{len(wid)}:50051",
        "m",
        "c",
        16,
        draining=draining,
        capacity=Capacity(**cap),
    )


def registry(*infos, clock=lambda: 0.0):
    r = WorkerRegistry(stale_after_s=2.0, clock=clock)
    for i in infos:
        r.put(i)
    return r


def test_prefill_backlog_is_queued_tokens_over_measured_rates():
    r = registry(
        info("p1", "prefill", queued_prefill_tokens=6000, prefill_tokens_per_s=2000.0),
        info("p2", "prefill", queued_prefill_tokens=0, prefill_tokens_per_s=1000.0),
        info(
            "p3", "prefill", draining=True, queued_prefill_tokens=9000, prefill_tokens_per_s=1000.0
        ),
    )
    assert pool_signals(r, 500.0).prefill_backlog_s == pytest.approx(6000 / 3000)
    r.get("p2").inflight_prefill_tokens = 3000  # sent by this router, not reported yet
    assert pool_signals(r, 500.0).prefill_backlog_s == pytest.approx(9000 / 3000)
    unmeasured = registry(info("p", "prefill", queued_prefill_tokens=1000))
    assert pool_signals(unmeasured, 500.0).prefill_backlog_s == pytest.approx(2.0)
    assert pool_signals(registry(), 500.0).prefill_backlog_s == 0.0


def test_decode_usage_and_waiting_over_usable_workers():
    now = [0.0]
    r = registry(
        info("d1", "decode", total_blocks=100, free_blocks=20, waiting=3),
        info("d2", "decode", total_blocks=300, free_blocks=300, waiting=1),
        clock=lambda: now[0],
    )
    s = pool_signals(r, 500.0)
    assert s.decode_kv_usage == pytest.approx(80 / 400) and s.decode_waiting == 3 + 1
    now[0] = 10.0  # both stale: no usable decode worker
    assert pool_signals(r, 500.0) == pool_signals(registry(), 500.0)
