"""The router's keys (router/http/auth.py): where they come from (flags, file, environment; the
first given wins), which ones are refused at start (empty, placeholders, unsendable, an admin
key that is also an API key), and which paths need which key — inference keys on /v1/*,
/tokenize and /detokenize, the admin key (else the API key) on the dev endpoints, LoRA
load/unload and /dashboard/data; /health, /metrics, /version and the dashboard page open."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from router_harness import start_cluster

from cluster.net import free_port
from router.config import RouterConfig
from router.http.auth import Access, Keys, access_of, resolve_keys, tenant_salt

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"


def keys(environ=None, **flags) -> Keys:
    return resolve_keys(RouterConfig(etcd="h:1", **flags), environ or {})


def refused(environ=None, **flags) -> str:
    with pytest.raises(ValueError) as info:
        keys(environ, **flags)
    return str(info.value)


# ---- where keys come from --------------------------------------------------------------------


def test_first_source_given_wins(tmp_path):
    file = tmp_path / "keys"
    file.write_text("from-file-0123456789abcdef\n")
    env = {
        "PDSERVE_API_KEY": "from-pdserve-env-0123456789abcdef",
        "VLLM_API_KEY": "from-vllm-env-0123456789abcdef",
    }
    assert keys(env, api_key="from-flag-0123456789abcdef") == Keys.of(
        ["from-flag-0123456789abcdef"]
    )
    assert keys(env, api_key_file=str(file)) == Keys.of(["from-file-0123456789abcdef"])
    assert keys(env) == Keys.of(["from-pdserve-env-0123456789abcdef"])
    assert keys({"VLLM_API_KEY": "from-vllm-env-0123456789abcdef"}) == Keys.of(
        ["from-vllm-env-0123456789abcdef"]
    )
    assert keys({}) == Keys()  # none: no key is needed (as vLLM)
    assert keys({"PDSERVE_ADMIN_API_KEY": "adm-0123456789abcdef"}) == Keys.of(
        [], ["adm-0123456789abcdef"]
    )
    # A variable reads like the file: what a Kubernetes Secret made from a key file holds.
    assert keys({"PDSERVE_API_KEY": "k1-0123456789abcdef\n"}) == Keys.of(["k1-0123456789abcdef"])
    assert keys({"PDSERVE_API_KEY": "k1-0123456789abcdef\r\nk2-0123456789abcdef\n"}) == Keys.of(
        ["k1-0123456789abcdef", "k2-0123456789abcdef"]
    )


def test_key_files(tmp_path):
    f = tmp_path / "keys"
    f.write_text(
        "one-0123456789abcdef\r\n"
    )  # one trailing newline, LF or CRLF, is not part of the key
    assert keys(api_key_file=str(f)) == Keys.of(["one-0123456789abcdef"])
    f.write_text(
        "one-0123456789abcdef\ntwo-0123456789abcdef\n"
    )  # several keys: one per line (vLLM: --api-key K1 K2)
    assert keys(api_key_file=str(f)) == Keys.of(["one-0123456789abcdef", "two-0123456789abcdef"])
    f.write_text("")
    assert refused(api_key_file=str(f)) == f"--api-key-file {f}: the file is empty"
    f.write_text("\n")
    assert "the file is empty" in refused(api_key_file=str(f))
    f.write_text("one-0123456789abcdef\n\n")
    assert "(key 2): the API key is empty" in refused(api_key_file=str(f))
    missing = tmp_path / "nope"
    assert refused(admin_api_key_file=str(missing)) == (
        f"--admin-api-key-file {missing}: cannot read it (No such file or directory)"
    )
    assert "cannot read it" in refused(api_key_file=str(tmp_path))  # a directory


def test_refused_keys_name_their_source():
    assert refused(api_key="").startswith("--api-key: the API key is empty")
    assert refused({"PDSERVE_API_KEY": ""}).startswith("PDSERVE_API_KEY: the API key is empty")
    assert refused({"VLLM_API_KEY": ""}).startswith("VLLM_API_KEY: the API key is empty")
    for placeholder in ("replace-me", "REPLACE-ME", "changeme", "your-api-key", "EMPTY"):
        assert f"{placeholder!r} is a placeholder" in refused(api_key=placeholder)
    assert "PDSERVE_ADMIN_API_KEY: 'changeme' is a placeholder" in refused(
        {"PDSERVE_ADMIN_API_KEY": "changeme"}
    )
    for unsendable in ("two words", "tab\there", "naïve", "line\nbreak"):
        message = refused(api_key=("ok-key-0123456789abcdef", unsendable))
        assert message.startswith("--api-key (key 2): an API key must be printable ASCII")
        assert unsendable not in message  # a real key never appears in a message
    assert refused(api_key="k", api_key_file="/f") == (
        "--api-key and --api-key-file are exclusive: give the keys one way"
    )


def test_admin_key_must_differ_and_salts_need_keys():
    assert "an admin key is also an API key" in refused(
        api_key=("a-0123456789abcdef", "b-0123456789abcdef"), admin_api_key="b-0123456789abcdef"
    )
    assert refused(cache_salt_from_api_key=True).startswith(
        "--cache-salt-from-api-key needs an API key"
    )
    assert "needs --admin-api-key" in refused(
        api_key=("a-0123456789abcdef", "b-0123456789abcdef"), cache_salt_from_api_key=True
    )
    salted = keys(
        api_key=("a-0123456789abcdef", "b-0123456789abcdef"),
        admin_api_key="adm-0123456789abcdef",
        cache_salt_from_api_key=True,
    )
    assert sorted(salted.salts.values()) == sorted(
        map(tenant_salt, ("a-0123456789abcdef", "b-0123456789abcdef", "adm-0123456789abcdef"))
    )
    assert keys(
        api_key="a-0123456789abcdef", cache_salt_from_api_key=True
    ).salts  # one tenant: allowed


def test_keys_are_never_logged_or_shown(caplog):
    secret = "sk-very-secret-0123456789"
    with caplog.at_level(logging.DEBUG, logger="router.http.auth"):
        resolved = keys(
            {"PDSERVE_ADMIN_API_KEY": secret + "-admin"},
            api_key=(secret, "sk-two-0123456789abcdef"),
        )
    assert "2 from --api-key" in caplog.text and "1 from PDSERVE_ADMIN_API_KEY" in caplog.text
    assert "sk-" not in caplog.text and "sk-" not in repr(resolved)


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--api-key", ""], {}, "--api-key: the API key is empty"),
        (["--api-key=replace-me"], {}, "--api-key: 'replace-me' is a placeholder"),
        (["--api-key", "sk-short"], {}, "--api-key: an API key must have at least 16 characters"),
        ([], {"PDSERVE_API_KEY": ""}, "PDSERVE_API_KEY: the API key is empty"),
        (
            ["--api-key-file", "/nonexistent/key"],
            {},
            "--api-key-file /nonexistent/key: cannot read",
        ),
        (
            ["--max-concurrent-requests-per-key", "4"],
            {},
            "--max-concurrent-requests-per-key needs API keys",
        ),
    ],
)
def test_pdserve_router_refuses_bad_keys_at_start(argv, env, message):
    """Exit 2 with the source named, before the model is loaded or a port is bound (today's
    router started without authentication, or with a placeholder key)."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PDSERVE_API_KEY", "VLLM_API_KEY", "PDSERVE_ADMIN_API_KEY")
    }
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "router",
            "--etcd",
            "127.0.0.1:1",
            "--port",
            str(free_port()),
            *argv,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, **env},
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"pdserve router: error: {message}" in out.stderr


# ---- which paths need which key ---------------------------------------------------------------


def test_access_of_paths():
    for path in (
        "/health",
        "/metrics",
        "/version",
        "/dashboard",
        "/openapi.json",
        "/docs",
        "/nothing",
    ):
        assert access_of(path) is Access.OPEN, path
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/models/x",
        "/v1/embeddings",
        "/v1/nothing",
        "/tokenize",
        "/detokenize",
    ):
        assert access_of(path) is Access.API, path
    for path in (
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/reset_prefix_cache",
        "/collective_rpc",
        "/update_weights",
        "/set_role",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/dashboard/data",
    ):
        assert access_of(path) is Access.ADMIN, path


def _error(response, status, code):
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.json()["error"]["code"] == code
    return response.json()["error"]


def _auth(key):
    return {"Authorization": f"Bearer {key}"} if key else {}


CALLS = {  # path -> (method, body)
    "/v1/models": ("GET", None),
    "/tokenize": ("POST", {"prompt": "hi"}),
    "/detokenize": ("POST", {"tokens": [1, 2]}),
    "/dashboard/data": ("GET", None),
    "/is_sleeping": ("GET", None),
    "/v1/unload_lora_adapter": ("POST", {"lora_name": "none"}),
}


def _call(url, path, key):
    method, body = CALLS[path]
    return httpx.request(method, url + path, json=body, headers=_auth(key), timeout=30)


@pytest.fixture(scope="module")
def admin_cluster(etcd, bg):
    c = start_cluster(
        bg,
        etcd.endpoint,
        "auth-admin",
        [("decode", "d1")],
        api_key=("sk-tenant-a-0123456789abcdef", "sk-tenant-b-0123456789abcdef"),
        admin_api_key="sk-admin-0123456789abcdef",
        enable_dev_endpoints=True,
        enable_lora=True,
    )
    yield c
    c.stop()


def test_admin_key_guards_the_admin_surface(admin_cluster):
    url = admin_cluster.router.url
    for path in ("/health", "/metrics", "/version", "/dashboard"):
        assert httpx.get(url + path, timeout=30).status_code == 200, path
    for path in ("/v1/models", "/tokenize", "/detokenize"):
        _error(_call(url, path, None), 401, "invalid_api_key")
        _error(_call(url, path, "sk-wrong"), 401, "invalid_api_key")
        for key in (
            "sk-tenant-a-0123456789abcdef",
            "sk-tenant-b-0123456789abcdef",
            "sk-admin-0123456789abcdef",
        ):
            assert _call(url, path, key).status_code == 200, (path, key)
    for path in ("/dashboard/data", "/is_sleeping", "/v1/unload_lora_adapter"):
        _error(_call(url, path, None), 401, "invalid_api_key")
        err = _error(_call(url, path, "sk-tenant-a-0123456789abcdef"), 403, "admin_key_required")
        assert err["type"] == "permission_error" and "--admin-api-key" in err["message"]
        assert _call(url, path, "sk-admin-0123456789abcdef").status_code not in (401, 403), path
    assert _call(url, "/dashboard/data", "sk-admin-0123456789abcdef").status_code == 200
    # vLLM's scheme check is case-insensitive; another scheme is no key.
    assert (
        httpx.get(
            url + "/v1/models",
            headers={"Authorization": "bearer sk-tenant-b-0123456789abcdef"},
            timeout=30,
        ).status_code
        == 200
    )
    _error(
        httpx.get(
            url + "/v1/models",
            headers={"Authorization": "Basic sk-tenant-b-0123456789abcdef"},
            timeout=30,
        ),
        401,
        "invalid_api_key",
    )
    text = httpx.get(url + "/metrics", timeout=30).text
    assert 'pdserve_router_requests_total{endpoint="/dashboard/data",status="403"}' in text


@pytest.fixture(scope="module")
def one_key_cluster(etcd, bg):
    c = start_cluster(
        bg,
        etcd.endpoint,
        "auth-one",
        [("decode", "d1")],
        api_key="sk-only-0123456789abcdef",
        enable_dev_endpoints=True,
        enable_lora=True,
    )
    yield c
    c.stop()


def test_without_admin_key_the_api_key_guards_everything(one_key_cluster):
    """/tokenize, /detokenize and /dashboard/data were open to anyone before."""
    url = one_key_cluster.router.url
    for path in CALLS:
        _error(_call(url, path, None), 401, "invalid_api_key")
        assert _call(url, path, "sk-only-0123456789abcdef").status_code not in (401, 403), path
    page = httpx.get(url + "/dashboard", timeout=30)  # the page holds no data: open
    code = httpx.get(url + "/dashboard/app.js", timeout=30)  # nor does its code
    assert page.status_code == code.status_code == 200
    assert '"Authorization": "Bearer " + key' in code.text
