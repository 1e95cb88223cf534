"""The router's HTTP edge (issue 51): the Host / Origin check against DNS rebinding and
cross-origin browser requests (router/http/host_check.py), --allowed-hosts, the back-off of
addresses that keep presenting wrong keys (router/http/auth_throttle.py), the minimum key
length, and 502s that name no worker address nor gRPC detail."""

import re

import httpx
import pytest
from router_harness import start_cluster

from engine.checks import FieldError
from router.config import RouterConfig
from router.http.allowed_hosts import HostRule, parse_allowed_host, split_authority
from router.http.auth import resolve_keys
from router.http.auth_throttle import FailedAuthThrottle, client_of
from router.http.host_check import HostCheck

KEY = "edge-test-key-0123456789"
CHAT = {
    "model": "SmolLM2-135M-Instruct",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
}


# ---- units -----------------------------------------------------------------------------------


def test_authorities_and_allowed_host_entries():
    assert split_authority("LocalHost:8000") == ("localhost", 8000)
    assert split_authority("[::1]:80") == ("::1", 80)
    assert split_authority("[::1]") == ("::1", None)
    assert split_authority("example.com") == ("example.com", None)
    for bad in ("", ":80", "a:b", "a:70000", "::1", "[::1", "a/b", "a@b", "[::1]x"):
        assert split_authority(bad) is None, bad
    assert parse_allowed_host("Api.Example.com:8443") == HostRule("api.example.com", 8443)
    assert parse_allowed_host("*") == HostRule("*")
    with pytest.raises(ValueError, match="not a URL"):
        parse_allowed_host("https://api.example.com")
    config = RouterConfig(etcd="h:1", allowed_hosts=("a.example, b.example:8443", "[::1]:9"))
    assert [str(r) for r in config.allowed_hosts] == ["a.example", "b.example:8443", "[::1]:9"]
    with pytest.raises(FieldError, match="allowed_hosts: 'a b' is not a host name"):
        RouterConfig(etcd="h:1", allowed_hosts=("a b",))


def _check(guard: HostCheck, host: str | None, origin: str | None = None):
    headers = [(b"host", host.encode())] if host is not None else []
    if origin is not None:
        headers.append((b"origin", origin.encode()))
    refused = guard.check({"type": "http", "headers": headers, "scheme": "http"})
    return None if refused is None else (refused.status, refused.code)


def test_host_rules_without_a_key():
    guard = HostCheck("127.0.0.1", (HostRule("llm.internal"), HostRule("b.example", 8443)), False)
    for ok in ("127.0.0.1:8000", "localhost", "LOCALHOST:1", "[::1]:8000", "llm.internal:9"):
        assert _check(guard, ok) is None, ok
    assert _check(guard, "b.example:8443") is None
    assert _check(guard, None) is None  # HTTP/1.0 without Host: no browser sends that
    rebinding = ("evil.example:8000", "b.example", "b.example:80", "10.0.0.1:8000", "x y", "")
    for host in rebinding:
        assert _check(guard, host) == (421, "host_not_allowed"), host
    # On a wildcard address any IP literal is served (rebinding needs a name); names are not.
    wildcard = HostCheck("0.0.0.0", (), False)
    assert _check(wildcard, "10.1.2.3:8000") is None and _check(wildcard, "[fd00::1]") is None
    assert _check(wildcard, "pdserve-router.default.svc:8000") == (421, "host_not_allowed")
    assert _check(HostCheck("0.0.0.0", (HostRule("*"),), False), "any.name") is None
    # With a key, the key protects the router: any Host.
    assert _check(HostCheck("127.0.0.1", (), True), "proxy.example") is None


def test_an_admin_key_alone_keeps_the_host_check():
    """With only an admin key, /v1/* is open: a rebinding page could still use the model."""
    from types import SimpleNamespace

    from router.http.auth import Keys
    from router.http.middleware import AuthAndCount

    def host_checked(keys: Keys) -> bool:
        services = SimpleNamespace(keys=keys, config=RouterConfig(etcd="h:1"))
        return AuthAndCount(None, services).hosts.check_host

    assert host_checked(Keys()) and host_checked(Keys.of([], [KEY]))
    assert not host_checked(Keys.of([KEY])) and not host_checked(Keys.of([KEY], [KEY + "-admin"]))


def test_origin_rules():
    for keyed in (False, True):
        guard = HostCheck("127.0.0.1", (HostRule("app.example"),), keyed)
        assert _check(guard, "127.0.0.1:8000", "http://127.0.0.1:8000") is None  # same origin
        assert _check(guard, "127.0.0.1:8000", "http://localhost:3000") is None  # a local page
        assert _check(guard, "127.0.0.1:8000", "https://app.example") is None  # allowed
        for origin in ("http://evil.example", "null", "garbage", "http://app.example.evil"):
            assert _check(guard, "127.0.0.1:8000", origin) == (403, "origin_not_allowed")
    keyed = HostCheck("0.0.0.0", (), True)
    assert _check(keyed, "api.example.com", "https://api.example.com") is None  # behind TLS
    assert _check(keyed, "api.example.com", "https://evil.example") == (403, "origin_not_allowed")


def test_throttle_backs_off_and_forgets():
    now = [1000.0]
    t = FailedAuthThrottle(max_failures=3, window_s=60, max_backoff_s=8, clock=lambda: now[0])
    for _ in range(2):
        t.failed("10.0.0.1")
    assert t.refused("10.0.0.1") is None
    t.failed("10.0.0.1")  # the third in a row: 1 s
    refused = t.refused("10.0.0.1")
    assert refused is not None and refused.status == 429
    assert refused.code == "too_many_failed_authentications"
    assert refused.headers["Retry-After"] == "1"
    assert t.refused("10.0.0.2") is None  # other addresses are not affected
    now[0] += 1.0
    assert t.refused("10.0.0.1") is None
    t.failed("10.0.0.1")  # one more: twice as long
    assert t.refused("10.0.0.1").headers["Retry-After"] == "2"
    for _ in range(10):
        now[0] += 10
        t.failed("10.0.0.1")
    assert t.refused("10.0.0.1").headers["Retry-After"] == "8"  # capped
    t.succeeded("10.0.0.1")  # a right key: forgotten
    assert t.refused("10.0.0.1") is None and len(t) == 0
    for _ in range(3):
        t.failed("10.0.0.3")
        now[0] += 61  # failures further apart than the window never add up
    assert t.refused("10.0.0.3") is None


def test_throttle_memory_is_bounded():
    t = FailedAuthThrottle(max_failures=1, max_clients=100, clock=lambda: 0.0)
    for i in range(10_000):
        t.failed(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}")
    assert len(t) == 100
    assert t.refused("10.0.39.15") is not None and t.refused("10.0.0.0") is None  # oldest out


def test_client_addresses():
    assert client_of({"client": ("10.0.0.7", 5555)}) == "10.0.0.7"
    assert client_of({"client": ("2001:db8:1:2:3:4:5:6", 1)}) == "2001:db8:1:2::/64"
    assert client_of({"client": ("::ffff:10.0.0.7", 1)}) == "10.0.0.7"
    assert client_of({}) == "-"


def test_short_keys_are_refused_by_source(tmp_path):
    def refused(environ=None, **flags):
        with pytest.raises(ValueError) as info:
            resolve_keys(RouterConfig(etcd="h:1", **flags), environ or {})
        return str(info.value)

    assert refused(api_key="sk-short").startswith(
        "--api-key: an API key must have at least 16 characters (this one has 8)"
    )
    f = tmp_path / "keys"
    f.write_text(KEY + "\nshort\n")
    assert refused(api_key_file=str(f)).startswith(f"--api-key-file {f} (key 2): an API key must")
    assert refused({"PDSERVE_ADMIN_API_KEY": "adm"}).startswith("PDSERVE_ADMIN_API_KEY: an API")
    assert refused({"VLLM_API_KEY": "x" * 15}).startswith("VLLM_API_KEY: an API key must")
    assert resolve_keys(RouterConfig(etcd="h:1", api_key="x" * 16), {}).api


# ---- a router on loopback, with fake workers ---------------------------------------------------


@pytest.fixture(scope="module")
def keyless(etcd, bg):
    c = start_cluster(
        bg,
        etcd.endpoint,
        "edge-keyless",
        [("decode", "d1"), ("decode", "d2")],
        allowed_hosts=("llm.lan",),
        enable_dev_endpoints=True,
        max_migrations=0,  # a failure mid-stream ends the stream (test_failed_workers_leak...)
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def keyed(etcd, bg):
    c = start_cluster(bg, etcd.endpoint, "edge-keyed", [("decode", "d1")], api_key=KEY)
    yield c
    c.stop()


def _error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert body["code"] == code and body["message"], body
    return body["message"]


def test_keyless_router_refuses_rebound_names_and_other_origins(keyless):
    url = keyless.router.url
    assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    port = url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", "llm.lan", f"llm.lan:{port}"):
        r = httpx.get(url + "/v1/models", headers={"Host": host}, timeout=30)
        assert r.status_code == 200, host
    # A page at attacker.example whose name now resolves to 127.0.0.1: same-origin for the
    # browser, so only the Host header tells. Every path, the admin surface included.
    rebound = {"Host": f"attacker.example:{port}", "Origin": f"http://attacker.example:{port}"}
    for method, path in (
        ("POST", "/v1/chat/completions"),
        ("POST", "/sleep"),
        ("GET", "/dashboard/data"),
        ("GET", "/health"),
    ):
        r = httpx.request(method, url + path, json=CHAT, headers=rebound, timeout=30)
        assert "--allowed-hosts" in _error(r, 421, "host_not_allowed")
    # A page of another origin posting to the router by its real name (a "simple" request).
    cross = {"Origin": "http://attacker.example"}
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=cross, timeout=30)
    _error(r, 403, "origin_not_allowed")
    r = httpx.post(url + "/sleep", headers=cross, timeout=30)
    _error(r, 403, "origin_not_allowed")
    assert r.headers.get("access-control-allow-origin") is None
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert 'endpoint="/v1/chat/completions",status="421"' in metrics


def test_keyed_router_serves_any_host_but_not_other_origins(keyed):
    url = keyed.router.url
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(url + "/v1/models", headers={**auth, "Host": "api.example.com"}, timeout=30)
    assert r.status_code == 200
    r = httpx.get(
        url + "/v1/models",
        headers={**auth, "Host": "api.example.com", "Origin": "https://api.example.com"},
        timeout=30,
    )
    assert r.status_code == 200
    r = httpx.get(url + "/v1/models", headers={**auth, "Origin": "https://evil.example"})
    _error(r, 403, "origin_not_allowed")


def test_wrong_keys_back_off_with_429(keyed):
    url = keyed.router.url
    throttle = None
    for i in range(30):
        r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer wrong-{i}"})
        if r.status_code == 429:
            throttle = r
            break
        _error(r, 401, "invalid_api_key")
    assert throttle is not None and i == 10, i  # refused after 10 wrong keys in a row
    _error(throttle, 429, "too_many_failed_authentications")
    assert int(throttle.headers["Retry-After"]) >= 1
    # Even the right key waits while the address backs off (a guess is not told apart); open
    # paths stay open (health checks from the same address keep working).
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    _error(r, 429, "too_many_failed_authentications")
    assert httpx.get(url + "/health").status_code == 200


def test_failed_workers_leak_no_address_nor_grpc_detail(keyless):
    for w in keyless.workers.values():
        w.behavior.fail_before_first_token = 100
    try:
        url = keyless.router.url
        for stream in (False, True):
            r = httpx.post(
                url + "/v1/chat/completions",
                json={**CHAT, "stream": stream},
                headers={"X-Request-Id": f"leak-check-{stream}"},
                timeout=30,
            )
            message = _error(r, 502, "worker_failed")
            assert f"request id leak-check-{stream}" in message
            for leak in ("127.0.0.1", "UNAVAILABLE", "injected", "d1", "d2", "grpc"):
                assert leak not in r.text, (leak, r.text)
        for w in keyless.workers.values():
            w.behavior.fail_before_first_token = 0
            w.behavior.fail_after_tokens = 1
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            json={**CHAT, "max_tokens": 8, "stream": True},
            headers={"X-Request-Id": "leak-check-mid"},
            timeout=30,
        ) as r:
            body = "".join(r.iter_text())
        assert "worker_failed" in body and "request id leak-check-mid" in body
        assert not re.search(r"127\.0\.0\.1|INTERNAL|injected|grpc", body), body
    finally:
        for w in keyless.workers.values():
            w.behavior.fail_before_first_token = 0
            w.behavior.fail_after_tokens = None
