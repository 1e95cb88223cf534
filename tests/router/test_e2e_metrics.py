"""Every metric docs/metrics.md lists is on a real process's /metrics: the router's and both
workers' of the session cluster, after one streamed completion (prefilled remotely, so KV moves).
The spec-decode counters are the exception: this cluster does not speculate, so they are
absent (tests/e2e/test_spec_decode_cluster.py finds them on a speculating decode worker).
"""

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai_cluster import MODEL

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: metrics_catalog
from metrics_catalog import documented, speculative_only, type_lines  # noqa: E402

pytestmark = pytest.mark.slow


def _scrape(address: str) -> str:
    return httpx.get(f"http://{address}/metrics", timeout=5).text


def _value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_every_documented_metric_is_exported_by_real_processes(e2e, client):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Metrics are exported by", max_tokens=4, temperature=0, stream=True
        )
    )
    assert chunks

    async def workers():
        return await e2e.workers()

    scrapes = {w.role: _scrape(w.metrics_address) for w in asyncio.run(workers())}
    scrapes["router"] = _scrape(e2e.url.removeprefix("http://"))
    assert set(scrapes) == {"router", "prefill", "decode"}
    doc = documented()
    for role, text in scrapes.items():
        process = "router" if role == "router" else "worker"
        types = type_lines(text)
        # this cluster does not speculate: the spec-decode counters are absent, as vLLM's
        # (tests/e2e/test_spec_decode_cluster.py checks them on a speculating decode worker)
        expected = {n: t for n, (t, p) in doc.items() if p == process and not speculative_only(n)}
        missing = {n: t for n, t in expected.items() if types.get(n) != t}
        assert not missing, f"{role} /metrics lacks (or mistypes) {missing}"
        assert not [n for n in types if speculative_only(n)], role

    decode, prefill, router = scrapes["decode"], scrapes["prefill"], scrapes["router"]
    # vLLM's request histograms are observed by the decode worker, labelled like vLLM's
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
    ):
        assert _value(decode, f"vllm:{name}_count", role="decode", engine="0") >= 1, name
        assert _value(prefill, f"vllm:{name}_count") == 0, name
    assert 'model_name="' in next(
        line for line in decode.splitlines() if line.startswith("vllm:kv_cache_usage_perc{")
    )
    # engine stats are refreshed every 0.2 s: poll (the first token came from the prefill side)
    by_address = {w.role: w.metrics_address for w in asyncio.run(workers())}
    deadline = time.monotonic() + 10
    while _value(decode, "vllm:generation_tokens_total") < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
        decode = _scrape(by_address["decode"])
    assert _value(decode, "vllm:generation_tokens_total") >= 3
    assert _value(prefill, "vllm:prefix_cache_queries_total") > 0
    # the KV moved and was counted on both sides; the router recorded the placement
    assert _value(prefill, "pdserve_kv_transfer_bytes_total", direction="send") > 0
    assert _value(decode, "pdserve_kv_transfer_bytes_total", direction="receive") > 0
    assert _value(router, "pdserve_router_routing_decisions_total") >= 1
    assert (
        _value(router, "pdserve_router_workers", role="decode", state="ready") >= 1
        or _value(router, "pdserve_router_workers", role="decode") >= 1
    )
