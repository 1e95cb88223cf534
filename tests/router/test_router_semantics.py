"""vLLM's request semantics through the router's HTTP app (fake workers record the
GenerateRequest they got): fields passed on, defaults (OpenAI's and the model's generation
config), truncation, max_model_len from the workers, and 400s for what pdserve lacks."""

import json
import logging
import os
import uuid

import httpx
import pytest
from router_harness import start_cluster, wait_for

from cluster.registration import WorkerInfo
from router.config import RouterConfig
from router.server import load_model_card

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def cluster(etcd, bg):
    c = start_cluster(bg, etcd.endpoint, "semantics", [("decode", "d1")])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.router.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def tok(cluster):
    return cluster.services.card.tokenizer


def last_request(cluster, worker="d1"):
    return cluster.workers[worker].requests[-1]


def ok(response):
    assert response.status_code == 200, response.text
    return response.json()


def error(response, param):
    assert response.status_code == 400, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err


def test_new_sampling_fields_reach_the_worker(cluster, http):
    ok(
        http.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "hello",
                "logit_bias": {"5": 2.5, "17": -100},
                "allowed_token_ids": [5, 6, 7],
                "bad_words": ["foo bar"],
                "min_tokens": 2,
                "include_stop_str_in_output": True,
                "priority": -3,
                "stop": ["x"],
            },
        )
    )
    q = last_request(cluster)
    s = q.sampling
    assert dict(s.logit_bias) == {5: 2.5, 17: -100.0}
    assert list(s.allowed_token_ids) == [5, 6, 7] and list(s.bad_words) == ["foo bar"]
    assert s.include_stop_str_in_output and s.min_tokens == 2 and q.priority == -3
    assert s.max_tokens == 16  # completions default, as OpenAI and vLLM
    assert not s.HasField("prompt_logprobs") and not s.HasField("truncate_prompt_tokens")


def test_default_max_tokens(cluster, http):
    ok(http.post("/v1/chat/completions", json=CHAT))
    assert not last_request(cluster).sampling.HasField("max_tokens")  # up to the context
    ok(http.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 3}))
    assert last_request(cluster).sampling.max_tokens == 3
    ok(http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": None}))
    assert last_request(cluster).sampling.max_tokens == 16


def test_truncate_prompt_tokens_keeps_the_last_k(cluster, http):
    ids = list(range(10, 60))
    body = ok(
        http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": 8},
        )
    )
    q = last_request(cluster)
    assert list(q.prompt_token_ids) == ids[-8:] and q.sampling.truncate_prompt_tokens == 8
    assert body["usage"]["prompt_tokens"] == 8
    # -1: as many as the context leaves beside max_tokens (vLLM).
    ok(
        http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": -1},
        )
    )
    assert last_request(cluster).sampling.truncate_prompt_tokens == 8192 - 2
    assert list(last_request(cluster).prompt_token_ids) == ids
    # A prompt too long for the context fits once truncated.
    ok(
        http.post(
            "/v1/chat/completions",
            json={
                **CHAT,
                "messages": [{"role": "user", "content": "hello " * 9000}],
                "truncate_prompt_tokens": 100,
                "max_tokens": 2,
            },
        )
    )
    assert len(last_request(cluster).prompt_token_ids) == 100
    err = error(
        http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": ids, "max_tokens": 200, "truncate_prompt_tokens": 8000},
        ),
        "truncate_prompt_tokens",
    )
    assert "7992" in err["message"]
    error(
        http.post(
            "/v1/completions", json={"model": MODEL, "prompt": ids, "truncate_prompt_tokens": 0}
        ),
        "truncate_prompt_tokens",
    )


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("chat", {"use_beam_search": True}, "use_beam_search"),
        ("comp", {"length_penalty": 0.5}, "length_penalty"),
        ("comp", {"logits_processors": ["x"]}, "logits_processors"),
        ("chat", {"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
        ("comp", {"guided_choice": []}, "guided_choice"),
        ("comp", {"guided_grammar": "root ::= x"}, "guided_grammar"),
        ("chat", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ("chat", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ("chat", {"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
        ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
        (
            "comp",
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.name",
        ),
        ("chat", {"response_format": {"type": "structural_tag"}}, "response_format"),
        ("chat", {"tools": []}, "tools"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ("chat", {"chat_template": "{{ messages }}"}, "chat_template"),
        ("chat", {"echo": True}, "echo"),
        ("comp", {"logprob_token_ids": [1], "logprobs": 1}, "logprob_token_ids"),
        ("comp", {"return_token_ids": True}, "return_token_ids"),
        ("comp", {"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        ("comp", {"truncation_side": "right"}, "truncation_side"),
        ("comp", {"kv_transfer_params": {}}, "kv_transfer_params"),
        ("comp", {"vllm_xargs": {"a": 1}}, "vllm_xargs"),
        ("chat", {"reasoning_effort": "low"}, "reasoning_effort"),
        ("comp", {"suffix": "end"}, "suffix"),
        ("comp", {"best_of": 2}, "best_of"),
        ("comp", {"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
        (
            "chat",
            {"continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),
        ("comp", {"priority": 1 << 40}, "priority"),
        ("comp", {"allowed_token_ids": [10**8]}, "allowed_token_ids"),
        ("comp", {"allowed_token_ids": []}, "allowed_token_ids"),
        ("comp", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("comp", {"bad_words": [" "]}, "bad_words"),
        ("comp", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("comp", {"stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ],
)
def test_what_pdserve_lacks_is_a_400_naming_the_field(http, path, extra, param):
    if path == "chat":
        url, body = "/v1/chat/completions", {**CHAT, "max_tokens": 2}
    else:
        url, body = "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    err = error(http.post(url, json={**body, **extra}), param)
    assert err["type"] == "invalid_request_error"


def test_default_values_of_vllm_fields_are_accepted(http):
    ok(
        http.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "hi",
                "max_tokens": 2,
                "use_beam_search": False,
                "length_penalty": 1.0,
                "spaces_between_special_tokens": True,
                "truncation_side": "left",
                "response_format": {"type": "text"},
                "return_token_ids": False,
            },
        )
    )
    ok(
        http.post(
            "/v1/chat/completions",
            json={
                **CHAT,
                "max_tokens": 2,
                "tool_choice": "none",
                "parallel_tool_calls": True,
                "echo": False,
            },
        )
    )


def test_unknown_fields_are_ignored_with_one_warning(http, caplog):
    name = f"frobnicate_{uuid.uuid4().hex[:8]}"
    with caplog.at_level(logging.WARNING, logger="router.endpoints.base"):
        for _ in range(3):
            ok(
                http.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": "hi", "max_tokens": 1, name: 1},
                )
            )
    assert sum(name in r.getMessage() for r in caplog.records) == 1


def test_chat_template_input(cluster, http, tok):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    ok(
        http.post(
            "/v1/chat/completions",
            json={
                **CHAT,
                "messages": [{"role": "user", "content": parts, "name": "ann"}],
                "max_tokens": 1,
            },
        )
    )
    expected = tok.encode(tok.render_chat([{"role": "user", "content": "first\nsecond"}]))
    assert list(last_request(cluster).prompt_token_ids) == expected  # vLLM joins with "\n"
    ok(
        http.post(
            "/v1/chat/completions",
            json={
                **CHAT,
                "max_tokens": 1,
                "continue_final_message": True,
                "add_generation_prompt": False,
                "messages": [
                    {"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": "The answer is"},
                ],
            },
        )
    )
    assert tok.decode(last_request(cluster).prompt_token_ids).endswith(
        "<|im_start|>assistant\nThe answer is"
    )
    # add_generation_prompt left at its default yields to continue_final_message.
    ok(
        http.post(
            "/v1/chat/completions",
            json={
                **CHAT,
                "max_tokens": 1,
                "continue_final_message": True,
                "messages": [{"role": "assistant", "content": "Once"}],
            },
        )
    )
    assert tok.decode(last_request(cluster).prompt_token_ids).endswith("assistant\nOnce")


@pytest.fixture(scope="module")
def custom_model(tmp_path_factory, model_dir):
    """The default model with a generation_config.json of its own and a chat template that
    shows `name` and a `greeting` template variable."""
    d = tmp_path_factory.mktemp("custom") / MODEL
    d.mkdir()
    for f in ("tokenizer.json", "config.json", "model.safetensors"):
        os.symlink(model_dir / f, d / f)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{{ greeting }}|{% for m in messages %}{{ m.role }}/{{ m.name }}:"
        "{{ m.content }}|{% endfor %}"
    )
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": 2,
                "temperature": 0.0,
                "top_p": 0.5,
                "top_k": 7,
                "repetition_penalty": 1.25,
                "max_new_tokens": 5,
            }
        )
    )
    return d


@pytest.fixture(scope="module")
def custom(etcd, bg, custom_model):
    c = start_cluster(
        bg,
        etcd.endpoint,
        "semantics-custom",
        [("decode", "d1")],
        model=str(custom_model),
        max_model_len=64,
    )
    yield c
    c.stop()


def test_generation_config_defaults(custom):
    with httpx.Client(base_url=custom.router.url, timeout=30) as http:
        ok(http.post("/v1/chat/completions", json=CHAT))
        s = last_request(custom).sampling
        assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0.0, 0.5, 7, 5)
        assert s.repetition_penalty == pytest.approx(1.25)
        ok(
            http.post(
                "/v1/chat/completions",
                json={**CHAT, "temperature": 0.9, "top_k": 3, "max_tokens": 9},
            )
        )
        s = last_request(custom).sampling
        assert (s.temperature, s.top_k, s.max_tokens, s.top_p) == (pytest.approx(0.9), 3, 9, 0.5)
        # Completions keep their own default (16); max_new_tokens only fills an omitted one.
        ok(http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}))
        assert last_request(custom).sampling.max_tokens == 16
        # The model's default is clamped to the context (64 here), never refused.
        long_chat = {**CHAT, "messages": [{"role": "user", "content": "a " * 55}]}
        ok(http.post("/v1/chat/completions", json=long_chat))
        q = last_request(custom)
        assert q.sampling.max_tokens == 64 - len(q.prompt_token_ids) < 5


def test_generation_config_sources(custom_model):
    assert (
        load_model_card(RouterConfig(etcd="", model=str(custom_model))).sampling_defaults[
            "max_tokens"
        ]
        == 5
    )
    assert (
        load_model_card(
            RouterConfig(etcd="", model=str(custom_model), generation_config="vllm")
        ).sampling_defaults
        == {}
    )
    card = load_model_card(RouterConfig(etcd="", generation_config=str(custom_model)))
    assert card.sampling_defaults["top_k"] == 7
    with pytest.raises(ValueError, match="generation-config"):
        load_model_card(RouterConfig(etcd="", generation_config="/nonexistent"))


def test_chat_template_kwargs_and_name_reach_the_template(custom):
    tok = custom.services.card.tokenizer
    with httpx.Client(base_url=custom.router.url, timeout=30) as http:
        ok(
            http.post(
                "/v1/chat/completions",
                json={
                    **CHAT,
                    "max_tokens": 1,
                    "chat_template_kwargs": {"greeting": "HELLO"},
                    "messages": [{"role": "user", "content": "hi", "name": "ann"}],
                },
            )
        )
    assert tok.decode(last_request(custom).prompt_token_ids) == "HELLO|user/ann:hi|"


def test_max_model_len_comes_from_the_workers(etcd, bg):
    c = start_cluster(bg, etcd.endpoint, "semantics-len", [("decode", "small"), ("decode", "big")])
    try:
        with httpx.Client(base_url=c.router.url, timeout=30) as http:
            # Nothing published yet: the router's own limit (the model's 8192).
            ids = list(range(1, 51))
            error(
                http.post(
                    "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 8150}
                ),
                "max_tokens",
            )
            c.workers["small"].max_model_len, c.workers["big"].max_model_len = 100, 1000
            # Both published (an unpublished 0 would mean "assumed to fit" and admit "small").
            c.bg.run(
                wait_for(
                    lambda: {w.info.max_model_len for w in c.services.registry.all()} == {100, 1000}
                )
            )
            assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 1000
            for _ in range(4):  # never placed where it cannot fit
                ok(
                    http.post(
                        "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 500}
                    )
                )
            assert len(c.workers["big"].requests) == 4 and not c.workers["small"].requests
            err = error(
                http.post(
                    "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 951}
                ),
                "max_tokens",
            )
            assert err["code"] == "context_length_exceeded" and "1000" in err["message"]
            error(
                http.post(
                    "/v1/chat/completions",
                    json={**CHAT, "messages": [{"role": "user", "content": "hello " * 1200}]},
                ),
                "messages",
            )
    finally:
        c.stop()


def test_worker_info_without_max_model_len_still_parses():
    info = WorkerInfo("w", "decode", "h:1", MODEL, "c", 16)
    doc = json.loads(info.to_json())
    del doc["max_model_len"]
    assert WorkerInfo.from_json(json.dumps(doc).encode()).max_model_len == 0
