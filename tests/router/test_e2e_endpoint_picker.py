"""The endpoint picker on the real cluster (prefill + decode workers, etcd with users, cluster
token): a `pdserve router --endpoint-picker-port` process answers an ext_proc exchange as Envoy
makes it (API key checked, the chat template and tokenizer run, the placement named), and the
request sent as the gateway would send it — to the endpoint named, with the picker's headers —
runs on the workers named and returns what the cluster's plain router returns (greedy)."""

import asyncio
import json

import httpx
from envoy_ext_proc import FULL_DUPLEX, process
from openai_cluster import KEY, MODEL, start_router

from cluster.net import free_port

CHAT = {
    "model": MODEL,
    "max_tokens": 6,
    "temperature": 0,
    "messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
}


def test_the_picked_placement_runs_and_matches_the_plain_router(e2e):
    picker_port = free_port()
    with start_router(
        e2e.etcd,
        e2e.logs,
        "--endpoint-picker-port",
        str(picker_port),
        security=e2e.router_security,
        name="picker-router",
    ) as url:
        auth = {"authorization": f"Bearer {KEY}"}
        body = json.dumps(CHAT).encode()
        refused = asyncio.run(
            process(f"127.0.0.1:{picker_port}", "/v1/chat/completions", body, body_mode=FULL_DUPLEX)
        )
        assert refused.status == 401  # the router's own key check, at the gateway
        ans = asyncio.run(
            process(
                f"127.0.0.1:{picker_port}",
                "/v1/chat/completions",
                body,
                body_mode=FULL_DUPLEX,
                headers=auth,
            )
        )
        assert ans.status is None and ans.body == body
        assert "http://" + ans.headers["x-gateway-destination-endpoint"] == url
        decode, prefill = (
            ans.headers["x-pdserve-decode-worker"],
            ans.headers["x-pdserve-prefill-worker"],
        )
        workers = {w.worker_id: w.role for w in asyncio.run(e2e.workers())}
        assert workers[decode] == "decode" and workers[prefill] == "prefill"  # remote prefill
        picked = httpx.post(
            url + "/v1/chat/completions",
            json=CHAT,
            timeout=120,
            headers={
                **auth,
                **{k: v for k, v in ans.headers.items() if k.startswith("x-pdserve-")},
            },
        )
        plain = httpx.post(e2e.url + "/v1/chat/completions", json=CHAT, headers=auth, timeout=120)
        assert picked.status_code == plain.status_code == 200, picked.text
        assert (
            picked.json()["choices"][0]["message"]["content"]
            == plain.json()["choices"][0]["message"]["content"]
        )
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'pdserve_router_placement_hints_total{outcome="followed"} 1.0' in metrics
        assert 'pdserve_router_endpoint_picks_total{outcome="placed"} 1.0' in metrics
        assert 'pdserve_router_endpoint_picks_total{outcome="refused"} 1.0' in metrics
