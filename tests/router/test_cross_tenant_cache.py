"""Cross-tenant leaks through the prefix cache (issue 28): a client guessing another client's
prompt reads whether its guess was cached. The victim sends public prefix + secret; the
attacker sends public prefix + a guess. With the guess right, one more block (16 tokens) is
cached: 48 cached tokens instead of 32 — in `usage.prompt_tokens_details.cached_tokens` and
in the dashboard's per-request predicted cached tokens.

Defences tested here: `cached_tokens` only with --enable-prompt-tokens-details (vLLM's
switch; both guesses then read none), the dashboard data behind the key, and
--cache-salt-from-api-key (different keys never share blocks: both guesses read the same
count even with the details on). A control run shows the attack works without them."""

import json

import httpx
import pytest
from router_harness import start_cluster

from router.http.auth import tenant_salt

MODEL = "SmolLM2-135M-Instruct"
PUBLIC = list(range(1000, 1032))  # two blocks everyone may know (a shared system prompt)
SECRET = list(range(2000, 2016))  # one block only the victim sent
WRONG = list(range(3000, 3016))


def _complete(url, key, prompt, **extra):
    r = httpx.post(
        url + "/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _attack(url, victim_key, attacker_key, tail):
    """(victim's own repeat, right guess, wrong guess): each one's usage.prompt_tokens_details.
    The attacker first sends the public prefix itself, so both guesses find it cached."""
    _complete(url, victim_key, PUBLIC + SECRET + tail)
    again = _complete(url, victim_key, PUBLIC + SECRET + tail[::-1])
    _complete(url, attacker_key, PUBLIC + tail)
    right = _complete(url, attacker_key, PUBLIC + SECRET + tail[1:])
    wrong = _complete(url, attacker_key, PUBLIC + WRONG + tail[1:])
    return [r["usage"]["prompt_tokens_details"] for r in (again, right, wrong)]


def _predicted(url, key, last):
    data = httpx.get(
        url + "/dashboard/data", headers={"Authorization": f"Bearer {key}"}, timeout=30
    ).json()
    return [d["predicted_cached_tokens"] for d in data["recent_decisions"][:last]]


@pytest.fixture
def cluster(etcd, bg, cluster_name, request):
    c = start_cluster(bg, etcd.endpoint, cluster_name, [("decode", "d1")], **request.param)
    yield c
    c.stop()


TWO_TENANTS = {
    "api_key": ("sk-victim-0123456789abcdef", "sk-attacker-0123456789abcdef"),
    "admin_api_key": "sk-admin-0123456789abcdef",
}


@pytest.mark.parametrize("cluster", [TWO_TENANTS], indirect=True)
def test_defaults_report_no_cached_tokens_and_hide_the_dashboard(cluster):
    """vLLM's default: no prompt_tokens_details unless asked for; the per-request predictions
    need the admin key."""
    url = cluster.router.url
    again, right, wrong = _attack(
        url, "sk-victim-0123456789abcdef", "sk-attacker-0123456789abcdef", list(range(5000, 5016))
    )
    assert again is None and right is None and wrong is None
    for key in (None, "sk-attacker-0123456789abcdef"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert httpx.get(url + "/dashboard/data", headers=headers, timeout=30).status_code in (
            401,
            403,
        )


@pytest.mark.parametrize(
    "cluster", [{**TWO_TENANTS, "enable_prompt_tokens_details": True}], indirect=True
)
def test_control_the_attack_works_without_salts(cluster):
    """What the guessing attack reads when tenants share the cache (why the salt exists)."""
    again, right, wrong = _attack(
        cluster.router.url,
        "sk-victim-0123456789abcdef",
        "sk-attacker-0123456789abcdef",
        list(range(6000, 6016)),
    )
    assert (again["cached_tokens"], right["cached_tokens"], wrong["cached_tokens"]) == (48, 48, 32)


@pytest.mark.parametrize(
    "cluster",
    [{**TWO_TENANTS, "enable_prompt_tokens_details": True, "cache_salt_from_api_key": True}],
    indirect=True,
)
def test_salts_from_the_key_make_right_and_wrong_guesses_alike(cluster):
    url = cluster.router.url
    again, right, wrong = _attack(
        url, "sk-victim-0123456789abcdef", "sk-attacker-0123456789abcdef", list(range(7000, 7016))
    )
    assert again["cached_tokens"] == 48  # a tenant still reuses its own prefixes
    assert right == wrong == {"cached_tokens": 32}  # the attacker's own public prefix only
    assert _predicted(url, "sk-admin-0123456789abcdef", 2) == [
        32,
        32,
    ]  # the router's index predicted alike
    # The worker got the tenant's salt; a request's own cache_salt subdivides it.
    _complete(url, "sk-attacker-0123456789abcdef", PUBLIC, cache_salt="team-1")
    salts = [q.cache_salt for q in cluster.workers["d1"].requests]
    assert salts[-1] == tenant_salt("sk-attacker-0123456789abcdef") + ":team-1"
    assert (
        salts[:-1]
        == [tenant_salt("sk-victim-0123456789abcdef")] * 2
        + [tenant_salt("sk-attacker-0123456789abcdef")] * 3
    )


def _usages(url, path, body):
    """Every `usage` of a streamed response (continuous usage stats: one per chunk)."""
    with httpx.stream(
        "POST",
        url + path,
        headers={"Authorization": "Bearer sk-victim-0123456789abcdef"},
        json={
            "model": MODEL,
            "max_tokens": 3,
            "stream": True,
            **body,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        timeout=30,
    ) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e)["usage"] for e in events[:-1]]


@pytest.mark.parametrize(
    "cluster, details",
    [(TWO_TENANTS, False), ({**TWO_TENANTS, "enable_prompt_tokens_details": True}, True)],
    indirect=["cluster"],
)
def test_prompt_tokens_details_only_when_enabled(cluster, details):
    """Streamed and not, chat and completions: vLLM's --enable-prompt-tokens-details."""
    url = cluster.router.url
    chat = {"messages": [{"role": "user", "content": "hello " * 40}]}
    for path, body in (
        ("/v1/completions", {"prompt": PUBLIC + SECRET}),
        ("/v1/chat/completions", chat),
    ):
        usages = _usages(url, path, body) + _usages(url, path, body)
        whole = httpx.post(
            url + path,
            headers={"Authorization": "Bearer sk-victim-0123456789abcdef"},
            json={"model": MODEL, "max_tokens": 2, **body},
            timeout=30,
        ).json()
        usages.append(whole["usage"])
        assert all("prompt_tokens_details" in u for u in usages)
        if details:
            assert all(set(u["prompt_tokens_details"]) == {"cached_tokens"} for u in usages)
            assert usages[-1]["prompt_tokens_details"]["cached_tokens"] >= 32  # sent before
        else:
            assert all(u["prompt_tokens_details"] is None for u in usages)
