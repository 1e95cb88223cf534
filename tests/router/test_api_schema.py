"""The router's contract in /openapi.json: every route declares its request and response
schemas (completeness), /docs renders, and schemathesis fuzzing from that schema (api_fuzz.py)
finds no 5xx, no undeclared status / content type / body, and no 4xx outside OpenAI's error
shape — against fake workers (the bulk: >= 1,000 requests) and the real session cluster."""

import asyncio

import httpx
import pytest
from api_fuzz import fuzz
from openai_cluster import CLUSTER, KEY
from router_harness import start_cluster

from router.http.auth import Access, access_of

_UNDECLARED = {"/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc"}


@pytest.fixture(scope="module")
def cluster(etcd, bg):
    c = start_cluster(
        bg,
        etcd.endpoint,
        "api-schema",
        [("decode", "d1"), ("prefill", "p1")],
        api_key="k-0123456789abcdef",
        enable_response_store=True,
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def doc(cluster):
    return httpx.get(cluster.router.url + "/openapi.json", timeout=30).raise_for_status().json()


def test_every_route_declares_its_schemas(cluster, doc):
    app = cluster.router.server.config.app
    routes = {
        (r.path.replace(":path", ""), m.lower())
        for r in app.routes
        if r.path not in _UNDECLARED
        for m in getattr(r, "methods", ())
        if m != "HEAD"
    }
    declared = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert routes == declared and len(routes) == 17
    components = doc["components"]["schemas"]
    for path, method in routes:
        op = doc["paths"][path][method]
        if method == "post":
            schema = op["requestBody"]["content"]["application/json"]["schema"]
            assert schema["$ref"].rsplit("/", 1)[1] in components, path
        ok = op["responses"]["200"]["content"]
        assert any("schema" in media or "itemSchema" in media for media in ok.values()), path
        for status, response in op["responses"].items():
            if status[0] in "45" and path != "/health":
                ref = response["content"]["application/json"]["schema"]["$ref"]
                assert ref == "#/components/schemas/ErrorResponse", (path, status)
        if access_of(path) is not Access.OPEN:  # the key check (router/http/auth.py) answers these
            assert "401" in op["responses"], path
        if access_of(path) is Access.ADMIN:
            assert "403" in op["responses"], path
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"400", "404", "500", "502", "503"} <= set(responses)
        assert "text/event-stream" in responses["200"]["content"]
    # /v1/responses: its own request and response models; named events, no [DONE]
    op = doc["paths"]["/v1/responses"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ResponsesRequest"
    )
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ResponsesResponse"
    )
    event = op["responses"]["200"]["content"]["text/event-stream"]["itemSchema"]
    assert event["required"] == ["event", "data"] and "[DONE]" not in str(event)
    assert event["properties"]["data"]["contentSchema"]["$ref"].endswith("/ResponseStreamEvent")
    request = components["ResponsesRequest"]
    # The one unknown-field policy (router/endpoints/base.py): allowed, ignored with a warning.
    assert request["additionalProperties"] is True
    assert {
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "text",
        "previous_response_id",
        "max_output_tokens",
        "store",
        "metadata",
    } <= set(request["properties"])
    assert {"ResponseStreamEvent", "OutputMessage", "FunctionCallOutput", "ReasoningOutput"} <= set(
        components
    )
    # vLLM's extras are in the published request schema.
    chat = components["ChatCompletionRequest"]["properties"]
    assert {
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "priority",
        "cache_salt",
        "chat_template_kwargs",
        "prompt_logprobs",
        "max_completion_tokens",
    } <= set(chat)
    assert "$defs" not in str(doc) and "HTTPValidationError" not in components


def test_docs_render(cluster):
    r = httpx.get(cluster.router.url + "/docs", timeout=30)
    assert r.status_code == 200 and "swagger-ui" in r.text and "/openapi.json" in r.text


def test_fuzz_findings(cluster):
    """What the fuzzer found: integers past the wire's uint32 were a 500; infinity got through."""

    def post(body):
        return httpx.post(
            cluster.router.url + "/v1/chat/completions",
            timeout=30,
            headers={"Authorization": "Bearer k-0123456789abcdef"},
            json={"messages": [{"role": "user", "content": "hi"}], **body},
        )

    assert post({"top_k": 1 << 33, "max_tokens": 2}).status_code == 200  # = every token
    r = post({"min_tokens": 1 << 33})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    r = httpx.post(
        cluster.router.url + "/v1/completions",
        timeout=30,
        headers={"Authorization": "Bearer k-0123456789abcdef", "Content-Type": "application/json"},
        content=b'{"prompt": "hi", "temperature": Infinity}',
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_fuzz_fake_workers(cluster):
    """>= 1,000 generated requests, positive and negative, in well under a minute. The fake
    cluster has no prefill worker: /v1/embeddings (prefill pool only, a 503 here by design)
    is fuzzed against the real cluster below."""
    stats = fuzz(
        cluster.router.url,
        {"Authorization": "Bearer k-0123456789abcdef"},
        examples=75,
        cap=16,
        skip=frozenset({"/v1/embeddings"}),
    )
    total = sum(stats.values())
    print(f"schemathesis (fake workers): {total} requests, {_summary(stats)}")
    assert total >= 1000
    ok = {(path, kind) for (mode, path, status, kind) in stats if status == 200}
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/tokenize",
        "/detokenize",
    ):
        assert (path, "json") in ok, f"no request to {path} succeeded"
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        assert (path, "sse") in ok, f"no streamed request to {path} succeeded"
    workers = cluster.workers.values()
    assert all(not w.active for w in workers)
    assert httpx.get(cluster.router.url + "/health").status_code == 200


@pytest.mark.slow
def test_fuzz_real_cluster(e2e):
    """A smaller run against real workers; then the cluster still serves and no worker holds
    a KV block."""
    stats = fuzz(
        e2e.url,
        {"Authorization": f"Bearer {KEY}"},
        examples=50,
        cap=4,
        fill_max_tokens=True,
        request_timeout=60.0,
    )
    print(f"schemathesis (real cluster): {sum(stats.values())} requests, {_summary(stats)}")
    r = httpx.post(
        e2e.url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"prompt": "Hello", "max_tokens": 3},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    asyncio.run(_all_blocks_free(e2e))


async def _all_blocks_free(e2e, timeout: float = 10.0) -> None:
    from pdserve.chaos.checks import leaked_blocks

    assert {w.role for w in await e2e.workers()} == {"prefill", "decode"}
    leaks = await leaked_blocks(
        e2e.etcd, CLUSTER, e2e.auth, timeout_s=timeout, credentials=e2e.etcd_credentials
    )
    assert leaks.value == {} and leaks.unsettled == {}, leaks


def _summary(stats) -> str:
    by = {}
    for (mode, _, status, kind), count in stats.items():
        by[(mode, status, kind)] = by.get((mode, status, kind), 0) + count
    return ", ".join(
        f"{mode} {status} {kind}: {n}" for (mode, status, kind), n in sorted(by.items())
    )
