"""The OpenAI API through the official `openai` client: router + fake workers + real etcd."""

import httpx
import openai
import pytest
from router_fakes import fake_token
from router_harness import start_cluster

from router.config import PlacementConfig

KEY = "sk-test-0123456789abcdef"


@pytest.fixture(scope="module")
def cluster(etcd, bg):
    # Every prompt prefills remotely: no threshold, and no TTFT estimate may keep one local
    # (the estimates learn from observed TTFTs, which a loaded machine inflates).
    c = start_cluster(
        bg,
        etcd.endpoint,
        "api",
        [("decode", "d1"), ("decode", "d2"), ("prefill", "p1")],
        PlacementConfig(local_prefill_threshold=0, local_prefill_max_tokens=0),
        api_key=KEY,
        enable_prompt_tokens_details=True,
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url, api_key=KEY, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def tok(cluster):
    return cluster.services.card.tokenizer


def expected(prompt, n_tokens, index=0):
    return "".join(f" w{fake_token(prompt, index, k)}" for k in range(n_tokens))


def chat_ids(tok, text):
    return tok.encode_chat([{"role": "user", "content": text}])


def all_requests(cluster):
    return [r for w in cluster.workers.values() for r in w.requests]


def test_models_and_health(cluster, client):
    [model] = client.models.list().data
    assert model.id == "SmolLM2-135M-Instruct" and model.owned_by == "pdserve"
    h = httpx.get(cluster.router.url + "/health").json()
    assert h == {"status": "ok", "decode_workers": 2, "prefill_workers": 1}


def test_chat_non_streaming(cluster, client, tok):
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=5,
        temperature=0,
    )
    prompt = chat_ids(tok, "Hello there")
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.message.content == expected(prompt, 5)
    assert choice.finish_reason == "length" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 5
    assert r.usage.total_tokens == len(prompt) + 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_streaming_with_usage(cluster, client, tok):
    chunks = list(
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Stream me"}],
            max_completion_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    prompt = chat_ids(tok, "Stream me")
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected(prompt, 4)
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens == len(prompt)


def test_completions_n2_non_streaming_and_streaming(cluster, client, tok):
    prompt = tok.encode("Once upon a time", add_special_tokens=True)
    r = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Once upon a time",
        max_tokens=3,
        n=2,
        temperature=0.7,
        seed=5,
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [expected(prompt, 3, 0), expected(prompt, 3, 1)]
    assert r.usage.completion_tokens == 6 and r.object == "text_completion"
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=3, n=2, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {0: expected(prompt, 3, 0), 1: expected(prompt, 3, 1)}


def test_stop_strings(cluster, client, tok):
    prompt = tok.encode("Stop here", add_special_tokens=True)
    third = f" w{fake_token(prompt, 0, 2)}"
    r = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Stop here", max_tokens=8, stop=[third, "never"]
    )
    assert r.choices[0].text == expected(prompt, 2) and r.choices[0].finish_reason == "stop"
    stops = [list(q.sampling.stop) for q in all_requests(cluster) if list(q.sampling.stop)]
    assert [third, "never"] in stops


def test_logprobs(cluster, client, tok):
    r = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Log me", max_tokens=3, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    # The sampled token (not among the fake's top 2) comes first, then the top 2 (as vLLM).
    assert lp.token_logprobs == [-0.5] * 3 and all(len(t) == 3 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        max_tokens=2,
        logprobs=True,
        top_logprobs=3,
        messages=[{"role": "user", "content": "x"}],
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 2 and all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].logprob == -0.5 and content[0].bytes == list(content[0].token.encode())
    chunks = list(
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            max_tokens=2,
            logprobs=True,
            stream=True,
            messages=[{"role": "user", "content": "x"}],
        )
    )
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(streamed) == 2 and all(e.top_logprobs == [] for e in streamed)


def test_sampling_and_extension_fields_reach_the_worker(cluster, client):
    client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "fields"}],
        max_tokens=2,
        temperature=0.5,
        top_p=0.9,
        seed=42,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        extra_body={
            "top_k": 7,
            "min_p": 0.1,
            "ignore_eos": True,
            "repetition_penalty": 1.1,
            "cache_salt": "tenant-a",
        },
    )
    q = [r for r in all_requests(cluster) if r.cache_salt == "tenant-a"][-1]
    s = q.sampling
    assert (s.top_k, s.seed, s.ignore_eos, s.max_tokens, s.n) == (7, 42, True, 2, 1)
    for got, want in [
        (s.temperature, 0.5),
        (s.top_p, 0.9),
        (s.min_p, 0.1),
        (s.presence_penalty, 0.5),
        (s.frequency_penalty, -0.5),
        (s.repetition_penalty, 1.1),
    ]:
        assert got == pytest.approx(want)
    assert not s.HasField("logprobs")


def _new_requests(workers, before):
    return [(w, q) for w in workers for q in w.requests[before[w.worker_id] :]]


def test_prefix_affinity_and_reported_cached_tokens(cluster, client):
    system = "You are a meticulous assistant. " * 40  # ~250 tokens: 15 shared blocks
    decoders = [w for w in cluster.workers.values() if w.role == "decode"]
    holders = set()
    for i in range(3):  # the shared prefix draws each request to the same decode worker
        before = {w.worker_id: len(w.requests) for w in decoders}
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            max_tokens=2,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"q{i}?"}],
        )
        [(worker, q)] = _new_requests(decoders, before)
        holders.add(worker.worker_id)
        assert q.HasField("prefill_worker")  # remote prefill (see the fixture)
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert cached == 0 if i == 0 else cached >= 224
    assert len(holders) == 1
    text = httpx.get(cluster.router.url + "/metrics").text
    assert 'pdserve_router_prefix_hit_tokens_total{source="predicted"}' in text
    assert 'pdserve_router_prefix_hit_tokens_total{source="reported"}' in text


def test_batch_of_prompts(cluster, client, tok):
    r = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=["alpha", "beta"], max_tokens=2, n=2
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    beta = tok.encode("beta", add_special_tokens=True)
    assert r.choices[3].text == expected(beta, 2, 1)
    r = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=[[1, 2, 3], [4, 5]], max_tokens=1
    )
    assert r.choices[1].text == expected([4, 5], 1) and r.usage.prompt_tokens == 5


def test_metrics_count_requests_and_decisions(cluster, client):
    client.completions.create(model="SmolLM2-135M-Instruct", prompt="count me", max_tokens=1)
    text = httpx.get(cluster.router.url + "/metrics").text
    assert 'pdserve_router_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'pdserve_router_routing_decisions_total{policy="affinity",reason="remote"}' in text
    assert (
        "pdserve_router_ttft_seconds_count" in text and "pdserve_router_itl_seconds_count" in text
    )
    assert 'pdserve_router_workers{role="decode",state="ready"} 2.0' in text
