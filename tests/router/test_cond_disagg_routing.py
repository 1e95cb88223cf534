"""Load-aware conditional disaggregation end to end in the router: capacities published by
(fake) workers through real etcd decide whether a prompt is prefilled on the prefill pool or
on the decode worker, and the decision reaches the Generate call and /metrics."""

from dataclasses import replace

import httpx
import pytest
from router_harness import start_cluster, wait_for

from cluster.registration import Capacity
from router.config import PlacementConfig

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

#: A decode worker that measured its steps: decode steps of 4 rows in 0.02 s, steps with a
#: 256-token prompt chunk beside them in 0.148 s (0.0005 s a token), budget 2048, chunks
#: capped at 256.
MEASURED_DECODE = Capacity(
    total_blocks=1000,
    free_blocks=1000,
    running=4,
    decode_step_s=0.02,
    decode_step_tokens=4,
    prefill_step_s=0.148,
    prefill_step_tokens=260,
    prefill_tokens_per_s=1730.0,
    max_num_batched_tokens=2048,
    long_prefill_token_threshold=256,
)
BACKED_UP = Capacity(
    total_blocks=1000, free_blocks=1000, queued_prefill_tokens=10_000, prefill_tokens_per_s=1000.0
)  # 10 s of queue
IDLE = replace(BACKED_UP, queued_prefill_tokens=0, prefill_tokens_per_s=100_000.0)


@pytest.fixture
def cluster(etcd, bg, cluster_name):
    c = start_cluster(
        bg,
        etcd.endpoint,
        cluster_name,
        [("decode", "d1"), ("prefill", "p1")],
        PlacementConfig(local_prefill_threshold=0),
    )
    yield c
    c.stop()


def _publish(c, bg, worker_id: str, capacity: Capacity) -> None:
    c.workers[worker_id].capacity = capacity
    reg = c.services.registry
    bg.run(wait_for(lambda: reg.get(worker_id).info.capacity == capacity))


def _decision_counts(c) -> dict[str, float]:
    counts = {}
    for line in httpx.get(c.router.url + "/metrics").text.splitlines():
        if line.startswith("pdserve_router_routing_decisions_total{"):
            counts[line.split('reason="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return counts


def _chat(c) -> str:
    """One chat; the prefill worker its Generate call named ("" = the decode worker's own)."""
    assert (
        httpx.post(c.router.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    )
    return c.workers["d1"].requests[-1].prefill_worker.worker_id


def test_published_load_moves_prefills_between_the_pools(cluster, bg):
    c = cluster
    _publish(c, bg, "d1", MEASURED_DECODE)
    _publish(c, bg, "p1", BACKED_UP)
    assert _chat(c) == ""  # ~10 s behind the pool's queue vs ~0.15 s here
    _publish(c, bg, "p1", IDLE)
    assert _chat(c) == "p1"
    # Backed up again, but the decode worker's steps are at the 250 ms ITL SLO already (64
    # rows): even this short prompt's chunk beside them would push it over. The pool takes it.
    _publish(c, bg, "p1", BACKED_UP)
    _publish(
        c,
        bg,
        "d1",
        replace(
            MEASURED_DECODE,
            running=64,
            decode_step_s=0.25,
            decode_step_tokens=64,
            prefill_step_s=0.378,
            prefill_step_tokens=320,
        ),
    )
    assert _chat(c) == "p1"
    assert _decision_counts(c) == {"local_backlog": 1.0, "remote": 2.0}
