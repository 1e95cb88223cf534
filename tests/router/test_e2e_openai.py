"""The whole path with real processes: etcd + `pdserve prefill` + `pdserve decode` +
`pdserve router` (tests/router/openai_cluster.py), driven by the official `openai` client.
Greedy output through router -> prefill (KV over NIXL) -> decode equals a single engine's for
the same token ids."""

import time

import httpx
import pytest
from openai_cluster import MODEL
from openai_cluster import reference_output as _ref

pytestmark = pytest.mark.slow


def test_chat_greedy_equals_single_engine(client, reference):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = reference.tokenizer.encode_chat(messages)
    ref = _ref(reference, ids, temperature=0.0, max_tokens=12, ignore_eos=True)
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == ref.outputs[0].text
    )
    assert chunks[-1].usage.completion_tokens == 12


def test_completions_greedy_stop_and_logprobs(client, reference):
    prompt = "The quick brown fox"
    ids = reference.tokenizer.encode(prompt, add_special_tokens=True)
    ref = _ref(reference, ids, temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    full = ref.outputs[0].text
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=16,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == full
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 16
    assert lp.token_logprobs == pytest.approx(
        [x.logprob for x in ref.outputs[0].logprobs], abs=1e-3
    )
    # A stop string taken from the middle of the greedy text cuts it there.
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    if stop.strip():
        r = client.completions.create(
            model=MODEL,
            prompt=ids,
            temperature=0,
            max_tokens=16,
            stop=[stop],
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].text == full[: full.index(stop)]
        assert r.choices[0].finish_reason == "stop"


def test_n2_seeded_equals_single_engine(client, reference):
    prompt = "Once upon a time"
    ids = reference.tokenizer.encode(prompt, add_special_tokens=True)
    ref = _ref(reference, ids, temperature=0.8, max_tokens=8, n=2, seed=1234, ignore_eos=True)
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0.8,
        max_tokens=8,
        n=2,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in r.choices] == [o.text for o in ref.outputs]
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0.8,
        max_tokens=8,
        n=2,
        seed=1234,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [o.text for o in ref.outputs]


def test_repeated_prefix_is_reported_cached_and_predicted(e2e, client):
    system = "You answer in one short sentence and never use lists. " * 12

    def ask(q):
        return client.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
        )

    ask("first?")
    time.sleep(0.5)  # KV events reach the router
    second = ask("second?")
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    text = httpx.get(e2e.url + "/metrics").text
    values = {
        line.split("}")[0].split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdserve_router_prefix_hit_tokens_total{")
    }
    assert values["predicted"] >= 64 and values["reported"] >= 64
    assert 'pdserve_router_routing_decisions_total{policy="affinity",reason="remote"}' in text
