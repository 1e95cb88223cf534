"""What the router renders, as vLLM does: stop_reason, echo, prompt_logprobs, top_logprobs
holding the sampled token, exact text_offset (multi-byte text too), chat logprob bytes,
continuous usage in streams. Fake workers: router_fakes (logprob -0.5, rank 2, top = id+1..)."""

import json

import httpx
import openai
import pytest
from router_fakes import fake_token
from router_harness import start_cluster

MODEL = "SmolLM2-135M-Instruct"
TEXT = "Grüße, 世界! 🎉 naïve"


@pytest.fixture(scope="module")
def cluster(etcd, bg):
    c = start_cluster(bg, etcd.endpoint, "outputs", [("decode", "d1")])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.router.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def tok(cluster):
    return cluster.services.card.tokenizer


def post(http, path, body):
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(http, path, body):
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def words(prompt, n, index=0):
    return [f" w{fake_token(prompt, index, k)}" for k in range(n)]


def test_stop_reason(http, tok):
    prompt = tok.encode("stop", add_special_tokens=True)
    third = words(prompt, 3)[2]
    body = {"model": MODEL, "prompt": "stop", "max_tokens": 5, "stop": [third]}
    [c] = post(http, "/v1/completions", body)["choices"]
    assert (c["finish_reason"], c["stop_reason"], c["text"]) == (
        "stop",
        third,
        "".join(words(prompt, 2)),
    )
    [c] = post(http, "/v1/completions", {**body, "include_stop_str_in_output": True})["choices"]
    assert c["text"] == "".join(words(prompt, 3)) and c["stop_reason"] == third
    [c] = post(http, "/v1/completions", {**body, "stop": []})["choices"]
    assert c["finish_reason"] == "length" and "stop_reason" in c and c["stop_reason"] is None
    chat_prompt = tok.encode(tok.render_chat([{"role": "user", "content": "s"}]))
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "s"}],
        "max_tokens": 5,
        "stop": [words(chat_prompt, 2)[1]],
    }
    [c] = post(http, "/v1/chat/completions", chat)["choices"]
    assert c["stop_reason"] == words(chat_prompt, 2)[1] and c["finish_reason"] == "stop"
    chunks = stream(http, "/v1/chat/completions", chat)
    assert all("stop_reason" in ch["choices"][0] for ch in chunks[1:])
    assert chunks[-1]["choices"][0]["stop_reason"] == words(chat_prompt, 2)[1]
    chunks = stream(http, "/v1/completions", body)
    assert chunks[-1]["choices"][0]["stop_reason"] == third


def test_top_logprobs_hold_the_sampled_token(http):
    [c] = post(
        http, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "logprobs": 2}
    )["choices"]
    for token, top in zip(c["logprobs"]["tokens"], c["logprobs"]["top_logprobs"]):
        assert list(top)[0] == token and list(top.values()) == [-0.5, -0.25, -0.75]
    [c] = post(
        http, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "logprobs": 0}
    )["choices"]
    assert [list(t) for t in c["logprobs"]["top_logprobs"]] == [
        [t] for t in c["logprobs"]["tokens"]
    ]
    [c] = post(
        http,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": [5, 6],
            "max_tokens": 1,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
        },
    )["choices"]
    t = fake_token([5, 6], 0, 0)
    assert c["logprobs"]["tokens"] == [f"token_id:{t}"]
    assert c["logprobs"]["top_logprobs"] == [{f"token_id:{t}": -0.5, f"token_id:{t + 1}": -0.25}]


def test_echo(cluster, http, tok):
    prompt = tok.encode("Echo this", add_special_tokens=True)
    out = "".join(words(prompt, 2))
    [c] = post(
        http,
        "/v1/completions",
        {"model": MODEL, "prompt": "Echo this", "max_tokens": 2, "echo": True},
    )["choices"]
    assert c["text"] == "Echo this" + out and c["logprobs"] is None
    [c] = post(
        http,
        "/v1/completions",
        {"model": MODEL, "prompt": "Echo this", "max_tokens": 2, "echo": True, "logprobs": 1},
    )["choices"]
    assert cluster.workers["d1"].requests[-1].sampling.prompt_logprobs == 1  # vLLM: = logprobs
    lp = c["logprobs"]
    outs = [fake_token(prompt, 0, k) for k in range(2)]
    assert lp["tokens"] == [tok.decode([t]) for t in prompt + outs]
    assert lp["token_logprobs"] == [None] + [-0.5] * (len(prompt) + 1)
    assert lp["top_logprobs"][0] is None and list(lp["top_logprobs"][1]) == [
        tok.decode([prompt[1]]),
        tok.decode([prompt[1] + 1]),
    ]
    assert lp["text_offset"][len(prompt)] == len("Echo this")
    for token, offset in zip(lp["tokens"][: len(prompt)], lp["text_offset"]):
        assert c["text"][offset:].startswith(token)  # (the fake's text is not its tokens')
    # Token-id prompts echo their decoded text; streamed, the prompt leads the first chunk.
    chunks = stream(
        http,
        "/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 0},
    )
    assert chunks[0]["choices"][0]["text"] == tok.decode(prompt) + words(prompt, 1)[0]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == tok.decode(prompt) + out
    assert (
        sum((ch["choices"][0]["logprobs"]["text_offset"] for ch in chunks), []) == lp["text_offset"]
    )


def test_prompt_logprobs(http, tok):
    body = post(
        http,
        "/v1/completions",
        {"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 1, "prompt_logprobs": 2, "n": 2},
    )
    for c in body["choices"]:
        pl = c["prompt_logprobs"]
        assert pl[0] is None and len(pl) == 3
        assert list(pl[1]) == ["8", "9", "10"] and list(pl[2]) == ["9", "10", "11"]
        assert pl[1]["8"] == {"logprob": -0.5, "rank": 2, "decoded_token": tok.decode([8])}
        assert pl[1]["9"]["rank"] == 1 and pl[1]["10"] == {
            "logprob": -0.75,
            "rank": 2,
            "decoded_token": tok.decode([10]),
        }
    chat = post(
        http,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "p"}],
            "max_tokens": 1,
            "prompt_logprobs": 0,
        },
    )
    ids = tok.encode(tok.render_chat([{"role": "user", "content": "p"}]))
    assert "prompt_logprobs" not in chat["choices"][0]
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(ids)
    assert [list(e) for e in chat["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]
    plain = post(http, "/v1/completions", {"model": MODEL, "prompt": "q", "max_tokens": 1})
    assert plain["choices"][0]["prompt_logprobs"] is None


def test_token_bytes_are_the_real_bytes(tok):
    ids = tok.encode(TEXT)
    assert b"".join(tok.token_bytes(t) for t in ids) == TEXT.encode()
    partial = [t for t in ids if "\ufffd" in tok.decode([t])]
    assert partial and all(b"\xef\xbf\xbd" not in tok.token_bytes(t) for t in partial)
    assert tok.token_bytes(tok.token_id("<|im_end|>")) == b"<|im_end|>"


def _script(tok, text):
    """(id, text delta) as a detokenizer emits them: a partial character waits for the
    token that completes it."""
    ids, out, prev = tok.encode(text), [], ""
    for k in range(len(ids)):
        now = tok.decode(ids[: k + 1]).rstrip("\ufffd")
        out.append((ids[k], now[len(prev) :]))
        prev = now
    return out


@pytest.fixture
def multibyte(cluster, tok):
    script = _script(tok, TEXT)
    cluster.workers["d1"].behavior.script = script
    yield script
    cluster.workers["d1"].behavior.script = None


def test_text_offset_with_multibyte_output(http, tok, multibyte):
    [c] = post(
        http, "/v1/completions", {"model": MODEL, "prompt": "m", "max_tokens": 50, "logprobs": 0}
    )["choices"]
    assert c["text"] == TEXT
    lp = c["logprobs"]
    before = 0  # bytes of the tokens before token i
    for i, (token_id, _) in enumerate(multibyte):
        offset = lp["text_offset"][i]
        if "\ufffd" not in lp["tokens"][i]:
            assert c["text"][offset:].startswith(lp["tokens"][i])
        # Token i's first byte lies in the character starting at its offset.
        assert len(TEXT[:offset].encode()) <= before < len(TEXT[: offset + 1].encode())
        before += len(tok.token_bytes(token_id))
    chunks = stream(
        http, "/v1/completions", {"model": MODEL, "prompt": "m", "max_tokens": 50, "logprobs": 0}
    )
    assert (
        sum((ch["choices"][0]["logprobs"]["text_offset"] for ch in chunks), []) == lp["text_offset"]
    )


def test_chat_logprob_bytes(http, multibyte):
    [c] = post(
        http,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "m"}],
            "max_tokens": 50,
            "logprobs": True,
            "top_logprobs": 1,
        },
    )["choices"]
    content = c["logprobs"]["content"]
    assert bytes(b for e in content for b in e["bytes"]) == TEXT.encode()
    assert any("\ufffd" in e["token"] for e in content)
    assert all(len(e["top_logprobs"]) == 1 for e in content)


def test_continuous_usage_stats(cluster, http, tok):
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "u"}],
        "max_tokens": 3,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = stream(http, "/v1/chat/completions", chat)
    prompt = len(tok.encode(tok.render_chat([{"role": "user", "content": "u"}])))
    assert all(ch["usage"]["prompt_tokens"] == prompt for ch in chunks)
    completion = [ch["usage"]["completion_tokens"] for ch in chunks]
    assert completion == sorted(completion) and completion[0] == 0 and completion[-1] == 3
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"  # before the usage chunk
    assert chunks[-2]["usage"]["completion_tokens"] == 3
    chunks = stream(
        http, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}}
    )
    assert all(ch["usage"] is None for ch in chunks[:-1]) and chunks[-1]["usage"]
    client = openai.OpenAI(base_url=cluster.base_url, api_key="x", max_retries=0)
    got = list(
        client.completions.create(
            model=MODEL,
            prompt="u",
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert [g.usage.completion_tokens for g in got] == [1, 2, 2]
