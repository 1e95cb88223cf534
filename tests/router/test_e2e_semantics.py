"""Request semantics through the official `openai` client against a real cluster (router ->
prefill -> KV over NIXL -> decode): what a vLLM user sends gets vLLM's answer, checked against
a single engine and against the tokenizer, never against pdserve's own rendering code."""

import json

import httpx
import openai
import pytest
from openai_cluster import KEY, MODEL, WORKER_MAX_MODEL_LEN, reference_output, start_router

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {KEY}"}


def _gpt2_byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's published table): printable stand-in char -> byte."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def test_min_tokens_equals_max_tokens_matches_single_engine(client, reference):
    """EOS pushed to the top (logit_bias) would end the request at once; min_tokens masks it
    from sampling on both workers (the prefill worker samples the first token)."""
    messages = [{"role": "user", "content": "Hi"}]
    ids = reference.tokenizer.encode_chat(messages)
    eos = reference.tokenizer.eos_token_id
    bias = {eos: 100.0}
    early = reference_output(reference, ids, temperature=0.0, max_tokens=30, logit_bias=bias)
    assert early.outputs[0].token_ids == [eos]  # EOS comes first without min_tokens...
    n = 6
    ref = reference_output(
        reference, ids, temperature=0.0, max_tokens=n, min_tokens=n, logit_bias=bias
    )
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=n,
        logit_bias={str(eos): 100},
        extra_body={"min_tokens": n},
    )
    assert r.usage.completion_tokens == n == len(ref.outputs[0].token_ids)  # ...but not with it
    assert eos not in ref.outputs[0].token_ids
    assert r.choices[0].message.content == ref.outputs[0].text
    assert "<|im_end|>" not in r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=n,
        logit_bias={str(eos): 100},
        extra_body={"min_tokens": 2},
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "stop"


def test_streamed_stop_string_and_continuous_usage(client, reference):
    prompt = "Once upon a time"
    ids = reference.tokenizer.encode(prompt, add_special_tokens=True)
    full = (
        reference_output(reference, ids, temperature=0.0, max_tokens=20, ignore_eos=True)
        .outputs[0]
        .text
    )
    stop = full[8:14]  # spans tokens
    assert stop.strip()
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            temperature=0,
            max_tokens=20,
            stop=[stop],
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full[: full.index(stop) + len(stop)]
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [(f.finish_reason, f.model_extra.get("stop_reason")) for f in finals] == [("stop", stop)]
    usage = [c.usage.completion_tokens for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks) and usage == sorted(usage) and usage[-1] >= 2


def test_completion_logprobs_include_the_sampled_token_and_exact_offsets(client, reference):
    tok = reference.tokenizer
    r = client.completions.create(
        model=MODEL,
        prompt="Hello",
        temperature=1.5,
        seed=7,
        max_tokens=16,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert all(t in top for t, top in zip(lp.tokens, lp.top_logprobs))
    assert any(len(top) == 2 for top in lp.top_logprobs)  # sampled outside the top 1: both shown
    # Offsets index the returned text, multibyte characters split across tokens included
    # (echo: the prompt's tokens come first, at their offsets in the prompt's text).
    prompt = "Hi 😀 and 中文 😀!"
    ids = tok.encode(prompt)
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=1,
        logprobs=0,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    out = r.choices[0]
    assert out.text.startswith(prompt)
    offsets = out.logprobs.text_offset
    assert len(offsets) == len(ids) + 1 and offsets[0] == 0
    checked = 0
    for i, offset in enumerate(offsets[: len(ids)]):
        before = tok.decode(ids[:i])
        if "\ufffd" not in before:
            assert offset == len(before), (i, offsets)
            checked += 1
    assert checked >= len(ids) - 4  # all but the tokens inside the split characters
    assert offsets[-1] == len(prompt)  # the generated token starts right after the prompt


def test_chat_logprob_bytes_are_the_tokens_real_bytes(client, reference):
    tok = reference.tokenizer
    emoji = tok.encode("😀")  # three tokens, each an incomplete UTF-8 sequence alone
    decoder = _gpt2_byte_decoder()
    vocab = json.loads((reference.engine.loaded.model_dir / "tokenizer.json").read_text())["model"][
        "vocab"
    ]
    piece = {i: p for p, i in vocab.items()}
    real = {i: bytes(decoder[c] for c in piece[i]) for i in emoji}
    assert b"".join(real[i] for i in emoji) == "😀".encode()  # the reference table is right
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "smile"}],
        temperature=0,
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"allowed_token_ids": emoji, "ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert bytes(entry.bytes) in real.values(), entry
        assert all(bytes(alt.bytes) != "\ufffd".encode() for alt in entry.top_logprobs)


def test_chat_text_parts_join_and_continue_final_message(client, reference):
    tok = reference.tokenizer
    parts = [
        {"type": "text", "text": "What is"},
        {"type": "text", "text": "the capital of France?"},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], temperature=0, max_tokens=4
    )
    joined = [{"role": "user", "content": "What is\nthe capital of France?"}]
    assert r.usage.prompt_tokens == len(tok.encode_chat(joined))
    # continue_final_message: the assistant's last message stays open for the model to continue.
    msgs = [
        {"role": "user", "content": "Name a city."},
        {"role": "assistant", "content": "The city is"},
    ]
    rendered = tok.render_chat(msgs, add_generation_prompt=False)
    open_prompt = rendered[: rendered.rindex("The city is") + len("The city is")]
    ids = tok.encode(open_prompt)
    ref = reference_output(reference, ids, temperature=0.0, max_tokens=4, ignore_eos=True)
    r = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        temperature=0,
        max_tokens=4,
        extra_body={
            "continue_final_message": True,
            "add_generation_prompt": False,
            "ignore_eos": True,
        },
    )
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == ref.outputs[0].text


def test_generation_config_defaults_apply_when_omitted(e2e, reference, tmp_path):
    folder = tmp_path / "genconf"
    folder.mkdir()
    (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 3})
    )
    ids = reference.tokenizer.encode("The weather today is", add_special_tokens=True)
    greedy = (
        reference_output(reference, ids, temperature=0.0, max_tokens=3, ignore_eos=True)
        .outputs[0]
        .text
    )
    messages = [{"role": "user", "content": "Hi"}]
    chat_ids = reference.tokenizer.encode_chat(messages)
    chat_greedy = (
        reference_output(reference, chat_ids, temperature=0.0, max_tokens=3, ignore_eos=True)
        .outputs[0]
        .text
    )
    with start_router(
        e2e.etcd,
        e2e.logs,
        "--generation-config",
        str(folder),
        security=e2e.router_security,
        name="router-genconf",
    ) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        # temperature from the model's config; completions keep OpenAI's max_tokens default (16).
        r = c.completions.create(
            model=MODEL, prompt=ids, max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == greedy
        r = c.completions.create(model=MODEL, prompt=ids, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 16
        # chat without max_tokens: the model's max_new_tokens (within the context).
        r = c.chat.completions.create(
            model=MODEL, messages=messages, extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == 3 and r.choices[0].message.content == chat_greedy
        r = c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == 5  # a field the request sets wins


def test_tokenize_detokenize_version_model_and_request_id(e2e, reference):
    tok = reference.tokenizer
    r = httpx.post(
        e2e.url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}, headers=AUTH
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == WORKER_MAX_MODEL_LEN
    r = httpx.post(
        e2e.url + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]}, headers=AUTH
    )
    assert r.json() == {"prompt": "Hello world"}
    r = httpx.post(
        e2e.url + "/detokenize", json={"model": MODEL, "tokens": [tok.vocab_size + 1]}, headers=AUTH
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert httpx.get(e2e.url + "/version").json()["version"]
    r = httpx.get(e2e.url + f"/v1/models/{MODEL}", headers=AUTH)
    assert r.json()["id"] == MODEL and r.json()["max_model_len"] == WORKER_MAX_MODEL_LEN
    r = httpx.get(e2e.url + "/v1/models/no-such-model", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(
        e2e.url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
        headers={**AUTH, "X-Request-Id": "trace-42"},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
