"""Migration: a decode worker failing or stalling after tokens were streamed — the router
resumes the request on another one and the client's stream goes on without a seam; bounded;
timeouts. Router + fake workers (router_fakes.py) + real etcd."""

import json

import httpx
import pytest
from router_fakes import fake_token
from router_harness import start_cluster

MODEL = "SmolLM2-135M-Instruct"
PROMPT = [5, 6, 7]


@pytest.fixture
def make_cluster(etcd, bg, cluster_name):
    started = []

    def make(specs, **config):
        c = start_cluster(bg, etcd.endpoint, cluster_name, specs, **config)
        started.append(c)
        return c

    yield make
    for c in started:
        c.stop()


def _metric(c, name, **labels):
    return c.services.metrics.registry.get_sample_value(name, labels) or 0.0


def _expected(max_tokens):
    tokens = [fake_token(PROMPT, 0, k) for k in range(max_tokens)]
    return tokens, "".join(f" w{t}" for t in tokens)


def _stream(c, **body):
    """The SSE events (parsed; "[DONE]" kept as is) of one streamed completion."""
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "stream": True,
        "stream_options": {"include_usage": True},
        **body,
    }
    with httpx.stream("POST", c.router.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def _calls(c):
    return sorted(
        (r for w in c.workers.values() for r in w.requests),
        key=lambda r: len(r.resume_output_token_ids),
    )


def test_failure_mid_stream_continues_on_another_worker_without_a_seam(make_cluster):
    c = make_cluster([("decode", "d1"), ("decode", "d2")])
    for w in c.workers.values():
        w.behavior.fail_after_tokens = 4  # per call: the second call, resumed at 4, finishes
    tokens, text = _expected(7)
    events = _stream(c, max_tokens=7)
    assert events[-1] == "[DONE]" and "error" not in events[-2]
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(e["choices"][0]["text"] for e in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len({e["id"] for e in events[:-1]}) == 1
    assert events[-2]["usage"]["completion_tokens"] == 7
    first, second = _calls(c)
    assert not first.resume_output_token_ids
    assert list(second.resume_output_token_ids) == tokens[:4]
    assert second.resume_text_chars == len("".join(f" w{t}" for t in tokens[:4]))
    assert not second.HasField("prefill_worker")
    # The request brought no seed: the router drew one, and the migrated call carries it, so
    # the new worker draws what the first would have.
    assert first.sampling.HasField("seed") and second.sampling.seed == first.sampling.seed
    assert _metric(c, "pdserve_router_migrations_total", reason="error") == 1
    assert _metric(c, "pdserve_router_migration_seam_seconds_count") == 1
    # Not streamed: one body, the same text and usage.
    r = httpx.post(
        c.router.url + "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 7},
        timeout=30,
    ).json()
    assert r["choices"][0]["text"] == text and r["usage"]["completion_tokens"] == 7
    assert _metric(c, "pdserve_router_migrations_total", reason="error") == 2


def test_migrations_are_bounded_then_an_error_event(make_cluster):
    c = make_cluster([("decode", "d1"), ("decode", "d2"), ("decode", "d3")], max_migrations=1)
    for w in c.workers.values():
        w.behavior.fail_after_tokens = 2
    events = _stream(c, max_tokens=10)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "worker_failed"
    _, text = _expected(4)
    assert "".join(e["choices"][0]["text"] for e in events[:-2] if e["choices"]) == text
    assert len(_calls(c)) == 2  # the first call + one migration
    assert _metric(c, "pdserve_router_migration_failures_total", reason="limit") == 1


def test_a_worker_lost_after_its_last_token_is_resumed_for_its_end(make_cluster):
    """Every token came, only the end was lost (seen in the chaos run: a stalled worker after
    its 32nd of 32 tokens): the request is resumed with all its outputs and the worker ends
    it (`length`, with any text it held back: tests/engine/test_resume.py), no error."""
    c = make_cluster([("decode", "d1"), ("decode", "d2")])
    for w in c.workers.values():
        w.behavior.fail_before_finish = True
    tokens, text = _expected(5)
    events = _stream(c, max_tokens=5)
    assert events[-1] == "[DONE]" and "error" not in events[-2]
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(e["choices"][0]["text"] for e in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 5
    first, second = _calls(c)
    assert list(second.resume_output_token_ids) == tokens


def test_n_above_one_is_not_migrated(make_cluster):
    c = make_cluster([("decode", "d1"), ("decode", "d2")])
    for w in c.workers.values():
        w.behavior.fail_after_tokens = 3
    events = _stream(c, max_tokens=10, n=2)
    assert events[-2]["error"]["code"] == "worker_failed"
    assert len(_calls(c)) == 1
    assert _metric(c, "pdserve_router_migration_failures_total", reason="n") == 1


def test_stalled_worker_is_cancelled_and_the_request_migrated(make_cluster):
    c = make_cluster([("decode", "d1"), ("decode", "d2")], stall_timeout_s=0.5)
    for w in c.workers.values():
        w.behavior.stall_after_tokens = 3
    events = _stream(c, max_tokens=5)
    _, text = _expected(5)
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == text
    first, second = _calls(c)
    assert len(second.resume_output_token_ids) == 3
    assert any(first.request_id in w.cancelled for w in c.workers.values())
    assert _metric(c, "pdserve_router_migrations_total", reason="stall_timeout") == 1


def test_first_token_timeout_retries_on_another_worker(make_cluster):
    c = make_cluster([("decode", "stuck"), ("decode", "ok")], first_token_timeout_s=0.5)
    c.workers["stuck"].behavior.stall_after_tokens = 0
    _, text = _expected(3)
    for _ in range(2):  # the tie rotation places at least one on the stuck worker first
        r = httpx.post(
            c.router.url + "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
    stuck = c.workers["stuck"]
    assert stuck.requests and len(stuck.cancelled) == len(stuck.requests)
    assert _metric(c, "pdserve_router_retries_total") == len(stuck.requests)
    assert _metric(c, "pdserve_router_worker_failures_total", phase="before_first_token") == len(
        stuck.requests
    )
