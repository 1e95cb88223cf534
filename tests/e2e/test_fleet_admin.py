"""The fleet-wide admin endpoints through a real cluster: etcd + `pdserve prefill` + two
`pdserve decode` (all `--enable-sleep-mode --enable-admin-rpcs`, with the test worker
extension tests/e2e/admin_extension.py) + `pdserve router --enable-dev-endpoints
--api-key`, every prompt prefilled on the prefill worker (`--strict-remote-prefill`: never locally).

Sleep puts every worker to sleep (the KV pools freed and deregistered from NIXL); a request
meanwhile waits `--queue-timeout` and gets 503 with Retry-After; wake_up brings them back (the
pools re-registered at new addresses) and greedy output through a remote prefill is unchanged;
update_weights from a safetensors path bumps every worker's weights version and the
disaggregated output equals an offline engine loaded with those weights; collective_rpc
(an extension method) answers once per worker; a worker that fails is named in the error."""

import os

import httpx
import pytest
import torch
from admin_extension import EXTENSION_PATH, SPEC
from pd_cluster import NUM_LAYERS, WorkerProcess, wait_router_sees

from cluster.etcd_server import EtcdServer
from cluster.net import free_port
from engine import LLM, SamplingParams
from local_cluster.launcher import ServiceProcess

pytestmark = pytest.mark.slow

CLUSTER = "fleet"
KEY = "fleet-key-0123456789abcdef"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
GREEDY = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("fleet-logs")
    with EtcdServer() as etcd, pytest.MonkeyPatch.context() as mp:
        mp.setenv(
            "PYTHONPATH",
            os.pathsep.join(filter(None, [EXTENSION_PATH, os.environ.get("PYTHONPATH")])),
        )
        strict = {"prefill": (), "decode": ("--strict-remote-prefill",)}  # no local fallback
        workers = [
            WorkerProcess(
                role,
                etcd.endpoint,
                "--enable-sleep-mode",
                "--enable-admin-rpcs",
                "--worker-extension-cls",
                SPEC,
                *strict[role],
                log_dir=logs,
                cluster=CLUSTER,
            )
            for role in ("prefill", "decode", "decode")
        ]
        port = free_port()
        router = ServiceProcess(
            [
                "router",
                "--etcd",
                etcd.endpoint,
                "--cluster",
                CLUSTER,
                "--port",
                str(port),
                "--local-prefill-threshold",
                "0",
                "--local-prefill-max-tokens",
                "0",
                "--enable-dev-endpoints",
                "--queue-timeout",
                "1",
                "--api-key",
                KEY,
                "--log-level",
                "warning",
            ],
            logs / "router.log",
        )
        url = f"http://127.0.0.1:{port}"
        try:
            for w in workers:
                w.wait_ready()
            wait_router_sees(url, router, prefill=1, decode=2)
            yield url, workers
        finally:
            codes = [p.terminate(30) for p in (router, *workers) if p.alive()]
    assert set(codes) <= {0}


def _post(url: str, path: str, body: dict | None = None, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=120)


def _complete(url: str) -> httpx.Response:
    return _post(url, "/v1/completions", {"model": "default", "prompt": PROMPT, **GREEDY})


def _tokens(url: str) -> str:
    r = _complete(url)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_sleep_refuses_then_wake_up_serves_the_same(cluster):
    url, workers = cluster
    before = _tokens(url)
    assert _post(url, "/sleep", key=None).status_code == 401
    r = _post(url, "/sleep?level=1")
    assert r.status_code == 200, r.text
    assert r.json()["is_sleeping"] and len(r.json()["workers"]) == 3
    state = httpx.get(url + "/is_sleeping", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert state["is_sleeping"] and all(state["workers"].values())
    r = _complete(url)
    assert r.status_code == 503 and r.headers["retry-after"]
    assert "sleeping" in r.json()["error"]["message"]
    r = _post(url, "/collective_rpc", {"method": "is_sleeping"})
    assert r.status_code == 200 and r.json()["results"] == [True, True, True]
    assert len(set(r.json()["workers"])) == 3
    r = _post(url, "/wake_up")
    assert r.status_code == 200 and not r.json()["is_sleeping"]
    for _ in range(3):  # both decode workers (new pool addresses) through the prefill worker
        assert _tokens(url) == before
    assert _post(url, "/reset_prefix_cache").status_code == 200
    assert _post(url, "/sleep?level=3").status_code == 400


def _stream_then(url: str, max_tokens: int, path: str) -> tuple[list[str], httpx.Response]:
    """Stream a completion; once its first chunk arrived (it is in flight), POST `path` from
    another thread. Returns the stream's data lines and the admin call's response."""
    from concurrent.futures import ThreadPoolExecutor

    body = {
        "model": "default",
        "prompt": PROMPT,
        "temperature": 0.0,
        "ignore_eos": True,
        "max_tokens": max_tokens,
        "stream": True,
    }
    lines, admin = [], None
    with (
        ThreadPoolExecutor(1) as pool,
        httpx.stream(
            "POST",
            url + "/v1/completions",
            json=body,
            timeout=120,
            headers={"Authorization": f"Bearer {KEY}"},
        ) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if admin is None:
                    admin = pool.submit(_post, url, path)
        return lines, admin.result(timeout=60)


def test_sleep_drains_in_flight_requests_or_aborts_them(cluster):
    url, _ = cluster
    lines, r = _stream_then(url, 150, "/sleep")  # waits for the request to finish
    assert r.status_code == 200 and r.json()["is_sleeping"], r.text
    assert lines[-1] == "[DONE]" and '"finish_reason":"length"' in "".join(lines)
    assert _post(url, "/wake_up").status_code == 200
    lines, r = _stream_then(url, 5000, "/sleep?abort=true")  # does not wait for 5000 tokens
    assert r.status_code == 200 and r.json()["is_sleeping"], r.text
    assert len(lines) < 1000  # ended early (aborted), never hangs
    assert _post(url, "/wake_up").status_code == 200
    assert _tokens(url)  # serving again


def test_update_weights_equals_an_engine_with_those_weights(cluster, model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    url, _ = cluster
    before = _tokens(url)
    state = load_file(str(model_dir / "model.safetensors"))
    torch.manual_seed(0)
    changed = {
        n: t + 0.1 * torch.randn_like(t)
        for n, t in state.items()
        if n.startswith("model.layers.1.") and n.endswith("proj.weight")
    }
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    save_file({**state, **changed}, str(tmp_path / "model.safetensors"))
    r = _post(url, "/update_weights", {"path": str(tmp_path / "model.safetensors")})
    assert r.status_code == 200, r.text
    assert set(r.json()["weights_version"].values()) == {1}
    fresh = LLM(str(tmp_path), num_layers=NUM_LAYERS, dtype="float32", kv_cache_memory=16 << 20)
    out = fresh.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    expected = out[0].outputs[0].text
    assert expected != before
    for _ in range(3):  # the second and third hit the (new-version) prefix cache
        assert _tokens(url) == expected
    r = _post(url, "/update_weights", {"path": str(tmp_path / "missing.safetensors")})
    assert r.status_code == 404 and "3 of 3 workers" in r.json()["error"]["message"]


def test_a_failing_worker_is_named(cluster):
    url, workers = cluster
    r = _post(url, "/collective_rpc", {"method": "no_such_method"})
    assert r.status_code == 400
    assert all(w.worker_id in r.json()["error"]["message"] for w in workers)
    victim = workers[2]
    victim.kill()  # its registration outlives it for a lease (3 s)
    r = _post(url, "/reset_prefix_cache")
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert victim.worker_id in message and "1 of 3 workers" in message
