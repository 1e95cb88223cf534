"""Retries, failures mid-stream, back-pressure, client disconnects, draining — router + fake
workers + real etcd."""

import time

import httpx
import openai
import pytest
from router_harness import start_cluster, wait_for

from router.config import PlacementConfig

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture
def make_cluster(etcd, bg, cluster_name):
    started = []

    def make(specs, name="", **config):
        c = start_cluster(bg, etcd.endpoint, cluster_name + name, specs, **config)
        started.append(c)
        return c

    yield make
    for c in started:
        c.stop()


def _metric(c, needle):
    for line in httpx.get(c.router.url + "/metrics").text.splitlines():
        if line.startswith(needle):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_failure_before_first_token_is_retried_on_another_worker(make_cluster):
    c = make_cluster([("decode", "bad"), ("decode", "good")])
    c.workers["bad"].behavior.fail_before_first_token = 100
    client = openai.OpenAI(base_url=c.base_url, api_key="x", max_retries=0)
    for i, stream in enumerate((False, True, False, True)):
        # Prompts shorter than a block: no prefix affinity, so the tie rotation alternates.
        r = client.completions.create(model=MODEL, prompt=[i + 1] * 5, max_tokens=2, stream=stream)
        text = (
            "".join(ch.choices[0].text for ch in r if ch.choices) if stream else r.choices[0].text
        )
        assert text
    assert c.workers["bad"].requests, "the tie rotation should have tried the failing worker"
    assert _metric(c, "pdserve_router_retries_total") == len(c.workers["bad"].requests)


def test_all_workers_failing_is_a_502_not_a_hang(make_cluster):
    c = make_cluster([("decode", "d1"), ("decode", "d2")])
    for w in c.workers.values():
        w.behavior.fail_before_first_token = 100
    r = httpx.post(c.router.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["code"] == "worker_failed"
    r = httpx.post(c.router.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30)
    assert r.status_code == 502
    assert sum(len(w.requests) for w in c.workers.values()) == 4  # one retry each


def test_failure_after_first_token_ends_the_stream_with_an_error_event(make_cluster):
    c = make_cluster([("decode", "d1"), ("decode", "d2")], max_migrations=0)
    for w in c.workers.values():
        w.behavior.fail_after_tokens = 2
    with httpx.stream(
        "POST",
        c.router.url + "/v1/chat/completions",
        timeout=30,
        json={**CHAT, "max_tokens": 10, "stream": True},
    ) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert '"error"' in events[-2] and "worker_failed" in events[-2]
    assert events[-1] == "data: [DONE]"
    assert sum(len(w.requests) for w in c.workers.values()) == 1  # no migration allowed
    client = openai.OpenAI(base_url=c.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(**{**CHAT, "max_tokens": 10}, stream=True):
            pass
    r = httpx.post(c.router.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 10})
    assert r.status_code == 502


def test_no_capacity_waits_then_503_with_retry_after(make_cluster, bg):
    c = make_cluster([("decode", "d1")], queue_timeout_s=0.6)
    d1 = c.workers["d1"]
    d1.set_capacity(free_blocks=0)
    bg.run(wait_for(lambda: c.services.registry.get("d1").info.capacity.free_blocks == 0))
    t0 = time.monotonic()
    r = httpx.post(c.router.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 503 and r.headers["Retry-After"].isdigit()
    assert r.json()["error"]["code"] == "overloaded"
    assert 0.5 < time.monotonic() - t0 < 5
    assert (
        _metric(c, 'pdserve_router_routing_decisions_total{policy="affinity",reason="no_capacity"}')
        == 1
    )
    # Capacity that comes back while a request waits lets it through.
    bg.loop.call_later(0.2, lambda: d1.set_capacity(free_blocks=1000))
    r = httpx.post(c.router.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 200


def test_no_decode_workers_is_a_503(make_cluster):
    c = make_cluster([("prefill", "p1")], queue_timeout_s=0.2)
    assert httpx.get(c.router.url + "/health").status_code == 503
    assert (
        httpx.post(
            c.router.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}
        ).status_code
        == 503
    )


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_worker_call(make_cluster, bg, stream):
    c = make_cluster([("decode", "d1")])
    d1 = c.workers["d1"]
    d1.behavior.token_delay_s = 0.1
    body = {**CHAT, "max_tokens": 200, "stream": stream}
    if stream:
        with httpx.stream(
            "POST", c.router.url + "/v1/chat/completions", json=body, timeout=30
        ) as r:
            next(r.iter_lines())  # the stream is running; now walk away
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(c.router.url + "/v1/chat/completions", json=body, timeout=0.5)
    bg.run(wait_for(lambda: len(d1.cancelled) == 1, timeout=3))
    assert d1.cancelled == [d1.requests[0].request_id]
    bg.run(wait_for(lambda: c.services.registry.get("d1").inflight == 0))


def test_draining_workers_get_no_new_requests(make_cluster, bg):
    c = make_cluster(
        [("decode", "d1"), ("decode", "d2"), ("prefill", "p1"), ("prefill", "p2")],
        placement=PlacementConfig(local_prefill_threshold=0, local_prefill_max_tokens=0),
    )
    c.workers["d1"].draining = True
    c.workers["p1"].draining = True
    reg = c.services.registry
    bg.run(wait_for(lambda: reg.get("d1").info.draining and reg.get("p1").info.draining))
    for _ in range(4):
        assert httpx.post(c.router.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert not c.workers["d1"].requests and len(c.workers["d2"].requests) == 4
    assert {r.prefill_worker.worker_id for r in c.workers["d2"].requests} == {"p2"}


def test_round_robin_and_least_loaded_policies_serve(make_cluster):
    for policy in ("round_robin", "least_loaded"):
        c = make_cluster(
            [("decode", "d1"), ("decode", "d2")],
            name=policy,
            placement=PlacementConfig(policy=policy),
        )
        for _ in range(4):
            assert httpx.post(c.router.url + "/v1/chat/completions", json=CHAT).status_code == 200
        assert [len(w.requests) for w in c.workers.values()] == [2, 2]
        assert (
            _metric(
                c,
                f'pdserve_router_routing_decisions_total{{policy="{policy}",reason="local_short"}}',
            )
            == 4
        )
