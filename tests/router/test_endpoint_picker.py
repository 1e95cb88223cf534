"""The router as a Gateway API Inference Extension endpoint picker
(router/endpoint_picker/picker.py,
router/endpoint_picker/ext_proc.py): a client speaking ext_proc as Envoy does (envoy_ext_proc.py)
against a
real router process's picker port, over fake workers registered in a real etcd. The picker
answers with the GAIE destination header + `envoy.lb` metadata and the placement the router's
own placer makes (prefix affinity included); refusals are immediate responses with the
router's status and OpenAI error body; the router follows the hint it gets."""

import asyncio
import json
import statistics
import time

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2 as core
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy_ext_proc import BUFFERED, FULL_DUPLEX, process
from grpc_health.v1 import health_pb2, health_pb2_grpc
from router_fakes import MODEL_ID
from router_harness import start_cluster

from cluster.net import free_port
from router.endpoint_picker.config import EndpointPickerConfig
from router.endpoint_picker.picker import EndpointPicker
from router.placement.hint import (
    DECODE_HEADER,
    PREFILL_HEADER,
    SEAL_HEADER,
    SEAL_MAX_AGE_S,
    HintSeal,
    PlacementHint,
)
from router.placement.placer import PromptKey

PROMPT = list(range(1, 201))  # token ids: 12 full blocks of 16
JSON = {"content-type": "application/json"}


def body(prompt=PROMPT, **extra) -> bytes:
    return json.dumps({"model": MODEL_ID, "prompt": prompt, "max_tokens": 4, **extra}).encode()


@pytest.fixture
def gw(bg, etcd, cluster_name):
    port = free_port()
    c = start_cluster(
        bg,
        etcd.endpoint,
        cluster_name,
        [("decode", "d1"), ("decode", "d2"), ("prefill", "p1")],
        endpoint_picker=EndpointPickerConfig(port=port),
    )
    c.picker = f"127.0.0.1:{port}"
    c.endpoint = c.router.url.removeprefix("http://")
    yield c
    c.stop()


def ask(gw, path="/v1/completions", data=None, **kw):
    return gw.bg.run(process(gw.picker, path, data, **kw))


@pytest.mark.parametrize("mode", [BUFFERED, FULL_DUPLEX])
def test_the_answer_names_the_router_and_the_placers_workers(gw, mode):
    workers = gw.workers
    workers["d2"].store(PromptKey(PROMPT).hashes(16))  # d2 holds the prompt's prefix
    data = body()
    ans = ask(gw, data=data, body_mode=mode)
    assert ans.status is None
    assert ans.headers["x-gateway-destination-endpoint"] == gw.endpoint
    assert ans.metadata == {"envoy.lb": {"x-gateway-destination-endpoint": gw.endpoint}}
    assert ans.clear_route_cache
    assert ans.headers["x-pdserve-decode-worker"] == "d2"  # prefix affinity
    assert ans.headers["x-pdserve-prefill-worker"] in ("", "p1")
    expected = gw.services.placer.place(PromptKey(PROMPT), context=len(PROMPT) + 4)
    assert ans.headers["x-pdserve-prefill-worker"] == (
        expected.prefill.info.worker_id if expected.prefill else ""
    )
    if mode == FULL_DUPLEX:
        assert ans.body == data  # streamed back unchanged, after the headers answer
        assert ans.responses[0].WhichOneof("response") == "request_headers"
    else:
        assert ans.body is None
        assert [r.WhichOneof("response") for r in ans.responses] == [
            "request_headers",
            "request_body",
        ]


def test_refusals_are_immediate_responses_with_openai_bodies(gw):
    bad = ask(gw, data=b"{not json")
    assert bad.status == 400 and bad.error["error"]["code"] == "invalid_json"
    unknown = ask(gw, data=json.dumps({"model": "nope", "prompt": "hi"}).encode())
    assert unknown.status == 404 and "nope" in unknown.error["error"]["message"]
    chat_bad = ask(gw, "/v1/chat/completions", json.dumps({"model": MODEL_ID}).encode())
    assert chat_bad.status == 400 and chat_bad.error["error"]["param"] == "messages"
    empty = ask(gw, data=body(), subset=[])
    assert empty.status == 503
    plain = ask(gw, data=body(), headers={"content-type": "text/plain"})
    assert plain.status == 415  # the router's own Content-Type rule
    huge = ask(gw, data=body(prompt="x" * (16 << 20)))  # just over --max-request-body-bytes
    assert huge.status == 413 and huge.error["error"]["code"] == "request_too_large"
    key = ask(gw, data=body(), headers={"authorization": "Bearer wrong"})
    assert key.status is None  # this router asks for no key: the API is open


def test_a_streamed_body_is_refused_at_the_chunk_that_crosses_the_limit(gw):
    """FULL_DUPLEX_STREAMED: the picker does not collect a body past --max-request-body-bytes
    (16 MiB here) until its end; the 413 answers the chunk that crosses it."""

    async def stream() -> ep.ProcessingResponse:
        async with grpc.aio.insecure_channel(gw.picker) as channel:
            call = ep_grpc.ExternalProcessorStub(channel).Process()
            await call.write(
                ep.ProcessingRequest(
                    request_headers=ep.HttpHeaders(
                        headers=core.HeaderMap(
                            headers=[
                                core.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                                core.HeaderValue(key="content-type", raw_value=b"application/json"),
                            ]
                        )
                    ),
                    protocol_config=ep.ProtocolConfiguration(request_body_mode=FULL_DUPLEX),
                )
            )
            for _ in range(3):  # 3 x 6 MiB, never end_of_stream
                await call.write(
                    ep.ProcessingRequest(request_body=ep.HttpBody(body=b" " * (6 << 20)))
                )
            return await asyncio.wait_for(call.read(), 10)

    first = gw.bg.run(stream())
    assert first.immediate_response.status.code == 413
    assert json.loads(first.immediate_response.body)["error"]["code"] == "request_too_large"


def test_a_subset_is_obeyed_and_other_paths_pass_without_placement(gw):
    others = ["10.0.0.1:8000", "10.0.0.2:8000"]
    ans = ask(gw, data=body(), subset=others)
    assert ans.headers["x-gateway-destination-endpoint"] in others
    assert ans.headers["x-pdserve-decode-worker"] in ("d1", "d2")
    again = ask(gw, data=body(), subset=others)  # same decode worker: same router
    assert (
        again.headers["x-gateway-destination-endpoint"]
        == ans.headers["x-gateway-destination-endpoint"]
    )
    assert (
        ask(gw, data=body(), subset=[gw.endpoint, *others]).headers[
            "x-gateway-destination-endpoint"
        ]
        == gw.endpoint
    )
    models = ask(gw, "/v1/models", None)  # no body: picked on the headers
    assert models.headers == {
        "x-gateway-destination-endpoint": gw.endpoint,
        "x-pdserve-decode-worker": "",
        "x-pdserve-prefill-worker": "",
        "x-pdserve-placement-seal": "",
    }
    batch = ask(gw, data=body(prompt=[PROMPT, PROMPT[:50]]))  # the router places each prompt
    assert batch.headers["x-pdserve-decode-worker"] == ""


def test_no_usable_decode_worker_is_a_503(gw):
    async def drain():
        for wid in ("d1", "d2"):
            await gw.workers[wid].stop()
        while gw.services.registry.by_role("decode"):
            await asyncio.sleep(0.02)

    gw.bg.run(drain())
    ans = ask(gw, data=body())
    assert ans.status == 503 and ans.error["error"]["code"] == "overloaded"


def test_the_router_follows_the_hint_and_overrides_a_stale_one(gw):
    url = gw.router.url + "/v1/completions"
    seal = gw.services.hint_seal
    for target in ("d1", "d2"):
        r = httpx.post(
            url,
            content=body(),
            headers={**JSON, **seal.headers(PlacementHint(target, None))},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert gw.workers[target].requests[-1].prompt_token_ids == PROMPT
        assert not gw.workers[target].requests[-1].HasField("prefill_worker")
    r = httpx.post(
        url, content=body(), headers={**JSON, **seal.headers(PlacementHint("gone", None))}
    )
    assert r.status_code == 200
    text = gw.services.metrics.render().decode()
    assert 'pdserve_router_placement_hints_total{outcome="followed"} 2.0' in text
    assert 'pdserve_router_placement_hints_total{outcome="overridden"} 1.0' in text


def test_a_hint_the_picker_did_not_seal_is_ignored(gw):
    """Issue 51: a client that reaches the router's port directly (past the gateway) cannot
    steer its request: its own hint headers, a forged seal, a stale one or one sealed by
    another router are not followed (counted `unsealed`), and the request is placed by the
    router's own policy."""
    url = gw.router.url + "/v1/completions"
    real = gw.services.hint_seal
    hint = PlacementHint("d1", "p1")
    stale = HintSeal(real.secret, clock=lambda: time.time() - 2 * SEAL_MAX_AGE_S)
    forged = {**real.headers(hint), DECODE_HEADER: "d2"}  # d1's seal on a d2 hint
    attempts = [
        hint.headers(),  # no seal at all
        forged,
        stale.headers(hint),
        HintSeal().headers(hint),  # another router's secret
    ]
    for headers in attempts:
        r = httpx.post(url, content=body(), headers={**JSON, **headers}, timeout=30)
        assert r.status_code == 200, r.text
    text = gw.services.metrics.render().decode()
    assert 'pdserve_router_placement_hints_total{outcome="unsealed"} 4.0' in text
    assert 'pdserve_router_placement_hints_total{outcome="followed"} 0.0' in text


def test_the_seal_covers_both_workers_and_the_time():
    now = [1000.0]
    seal = HintSeal(b"k" * 32, clock=lambda: now[0])
    hint = PlacementHint("d1", None)
    headers = seal.headers(hint)
    assert seal.open(headers) == (hint, False)
    assert seal.open({**headers, PREFILL_HEADER: "p9"}) == (None, True)
    assert seal.open({**headers, SEAL_HEADER: headers[SEAL_HEADER] + "0"}) == (None, True)
    now[0] += SEAL_MAX_AGE_S + 1
    assert seal.open(headers) == (None, True)
    assert seal.open({}) == (None, False)  # no hint: nothing refused
    assert seal.headers(None) == {DECODE_HEADER: "", PREFILL_HEADER: "", SEAL_HEADER: ""}


def test_health_and_decision_latency(gw):
    """Prints the picker's decision latency through ext_proc next to the placer's own call
    (same router, same prompt): docs/kubernetes.md records them."""

    async def measure(n=200):
        async with grpc.aio.insecure_channel(gw.picker) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            for name in ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                resp = await check(health_pb2.HealthCheckRequest(service=name))
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            data, through = body(), []
            for _ in range(n):
                t0 = time.perf_counter()
                await process(gw.picker, "/v1/completions", data, channel=channel)
                through.append(time.perf_counter() - t0)
        picker, inside, chat = EndpointPicker(gw.services, gw.endpoint), [], []
        for _ in range(n):
            t0 = time.perf_counter()
            await picker.pick("/v1/completions", {}, data)
            inside.append(time.perf_counter() - t0)
        chat_body = json.dumps(
            {
                "model": MODEL_ID,
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": "Summarize the history of the printing press. " * 20,
                    }
                ],
            }
        )
        for _ in range(n):  # + the chat template and the tokenizer (~200 tokens)
            t0 = time.perf_counter()
            await picker.pick("/v1/chat/completions", {}, chat_body.encode())
            chat.append(time.perf_counter() - t0)
        placer, direct = gw.services.placer, []
        for _ in range(n):
            t0 = time.perf_counter()
            placer.place(PromptKey(PROMPT), context=len(PROMPT) + 4)
            direct.append(time.perf_counter() - t0)
        return through, inside, chat, direct

    through, inside, chat, direct = gw.bg.run(measure(), timeout=120)

    def q(xs, p):
        return statistics.quantiles(xs, n=100)[p - 1] * 1e3

    print(
        f"\next_proc decision (client round trip) p50 {q(through, 50):.3f} ms "
        f"p99 {q(through, 99):.3f} ms; EndpointPicker.pick (parse, tokenize, place) p50 "
        f"{q(inside, 50):.3f} ms p99 {q(inside, 99):.3f} ms; the same for a chat request "
        f"p50 {q(chat, 50):.3f} ms p99 {q(chat, 99):.3f} ms; placer.place p50 {q(direct, 50):.3f} "
        f"ms p99 {q(direct, 99):.3f} ms"
    )
    assert q(through, 50) < 100  # a loose bound: 2 shared cores


def test_the_pool_gauges_reach_metrics(gw):
    """The autoscaling signals (router/placement/pool_signals.py) as KEDA reads them from
    /metrics."""
    from router_harness import wait_for

    gw.workers["p1"].set_capacity(queued_prefill_tokens=4000, prefill_tokens_per_s=2000.0)
    gw.workers["d1"].set_capacity(total_blocks=1000, free_blocks=500, waiting=3)
    registry = gw.services.registry
    gw.bg.run(
        wait_for(
            lambda: (
                registry.get("p1").info.capacity.queued_prefill_tokens == 4000
                and registry.get("d1").info.capacity.waiting == 3
            )
        )
    )
    text = httpx.get(gw.router.url + "/metrics", timeout=10).text
    assert "pdserve_router_prefill_backlog_seconds 2.0" in text
    assert "pdserve_router_decode_kv_usage 0.25" in text  # 500 of 2000 blocks
    assert "pdserve_router_decode_waiting_requests 3.0" in text
