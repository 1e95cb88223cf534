"""Real workers publish measured step timings in etcd (what the router's TTFT estimates read,
docs/router.md): after a few completions, the prefill worker has measured its prefill steps
and the decode worker its decode steps, each next to its step budget."""

import asyncio
import time

import pytest
from openai_cluster import MODEL

pytestmark = pytest.mark.slow


def test_workers_publish_measured_step_timings(e2e, client):
    for i in range(3):  # the first step of each kind is warm-up, left out
        client.completions.create(
            model=MODEL, prompt=f"Capacity test number {i} is", max_tokens=6, temperature=0
        )

    async def capacities():
        return {w.role: w.capacity for w in await e2e.workers()}

    deadline = time.monotonic() + 10  # republished every 0.25 s
    caps = asyncio.run(capacities())
    while (
        not (caps["prefill"].prefill_step_s > 0 and caps["decode"].decode_step_s > 0)
        and time.monotonic() < deadline
    ):
        time.sleep(0.25)
        caps = asyncio.run(capacities())
    prefill, decode = caps["prefill"], caps["decode"]
    assert 0 < prefill.prefill_step_s < 10 and prefill.prefill_step_tokens >= 1
    assert prefill.prefill_tokens_per_s == pytest.approx(
        prefill.prefill_step_tokens / prefill.prefill_step_s, rel=0.01
    )  # no decodes there
    assert 0 < decode.decode_step_s < 10 and decode.decode_step_tokens >= 1
    assert prefill.max_num_batched_tokens > 0 and decode.max_num_batched_tokens > 0
