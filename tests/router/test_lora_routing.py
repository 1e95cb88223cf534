"""LoRA adapters in the router, against fake workers: adapter affinity in placement (with
prefix affinity and load), the adapter in Generate and in the block hashes, /v1/models,
load / unload fanned out to both pools with rollback, and the endpoints disabled by default."""

import httpx
import pytest
from router_harness import start_cluster

from cluster.registration import Capacity
from engine.kv.block_hash import compute_block_hashes
from engine.lora.request import LoRARequest, lora_id_for
from router.config import PlacementConfig
from router.placement.placer import PromptKey
from router.placement.policy import AffinityPolicy, Candidate, Reason

PROMPT = 1024


def cand(wid, running=0, cached=0, queued=0, lora_missing=False):
    return Candidate(
        wid,
        Capacity(
            total_blocks=1000,
            free_blocks=1000,
            running=running,
            queued_prefill_tokens=queued,
            prefill_tokens_per_s=1000.0,
        ),
        cached_tokens=cached,
        lora_missing=lora_missing,
    )


def test_decode_prefers_a_worker_with_the_adapter_loaded():
    policy = AffinityPolicy(PlacementConfig())
    decode = [cand("a", lora_missing=True), cand("b")]
    assert policy.place(PROMPT, decode, []).decode.worker_id == "b"
    # combined with prefix affinity and load: a long cached prefix or a much lighter load wins
    assert (
        policy.place(
            PROMPT, [cand("a", cached=768, lora_missing=True), cand("b")], []
        ).decode.worker_id
        == "a"
    )
    assert (
        policy.place(
            PROMPT, [cand("a", lora_missing=True), cand("b", running=16)], []
        ).decode.worker_id
        == "a"
    )
    assert (
        AffinityPolicy(PlacementConfig(lora_weight=0))
        .place(PROMPT, [cand("b", running=1), cand("a", lora_missing=True)], [])
        .decode.worker_id
        == "a"
    )


def test_prefill_counts_the_adapter_load_time():
    policy = AffinityPolicy(PlacementConfig(lora_load_s=0.5, local_prefill_max_tokens=0))
    d = policy.place(PROMPT, [cand("d")], [cand("p1", lora_missing=True), cand("p2", queued=400)])
    assert d.reason is Reason.REMOTE and d.prefill.worker_id == "p2"  # 0.4 s queue < 0.5 s load
    d = policy.place(PROMPT, [cand("d")], [cand("p1", lora_missing=True), cand("p2", queued=600)])
    assert d.prefill.worker_id == "p1"


def test_block_hashes_include_the_adapter():
    ids = list(range(100))
    lora = LoRARequest("x", lora_id_for("x"), "/x")
    assert PromptKey(ids, None, lora).hashes(16) == compute_block_hashes(
        ids[:96], 16, None, lora_id_for("x")
    )
    assert PromptKey(ids, None, lora).hashes(16) != PromptKey(ids).hashes(16)


@pytest.fixture(scope="module")
def lora_cluster(etcd, bg):
    c = start_cluster(
        bg,
        etcd.endpoint,
        "lora-routing",
        [("decode", "d1"), ("decode", "d2"), ("prefill", "p1"), ("prefill", "p2")],
        api_key="k-0123456789abcdef",
        enable_lora=True,
        placement=PlacementConfig(local_prefill_threshold=0, local_prefill_max_tokens=0),
    )
    yield c
    c.stop()


def _post(c, path, body):
    return httpx.post(
        c.router.url + path,
        json=body,
        headers={"Authorization": "Bearer k-0123456789abcdef"},
        timeout=30,
    )


def _models(c):
    r = httpx.get(
        c.base_url + "/models", headers={"Authorization": "Bearer k-0123456789abcdef"}, timeout=30
    )
    return {m["id"]: m for m in r.json()["data"]}


def test_load_fans_out_and_affinity_places_on_workers_with_the_adapter(lora_cluster):
    c = lora_cluster
    r = _post(c, "/v1/load_lora_adapter", {"lora_name": "fox", "lora_path": "/adapters/fox"})
    assert r.status_code == 200, r.text
    assert all(("load", "fox") in w.lora_calls for w in c.workers.values())
    card = _models(c)["fox"]
    assert card["parent"] == next(iter(_models(c))) and card["root"] == "/adapters/fox"
    # only d2 and p1 have it resident: placement goes there
    for wid in ("d2", "p1"):
        c.workers[wid].resident_loras = ("fox",)
    c.bg.run(_republish(c))
    for _ in range(4):
        r = httpx.post(
            c.base_url + "/completions",
            headers={"Authorization": "Bearer k-0123456789abcdef"},
            json={"model": "fox", "prompt": list(range(40)), "max_tokens": 2},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["model"] == "fox", r.text
    sent = c.workers["d2"].requests
    assert len(sent) == 4 and not c.workers["d1"].requests
    assert all(m.lora.name == "fox" and m.lora.path == "/adapters/fox" for m in sent)
    assert {m.prefill_worker.worker_id for m in sent} == {"p1"}
    r = _post(c, "/v1/unload_lora_adapter", {"lora_int_id": lora_id_for("fox")})
    assert r.status_code == 200 and "fox" not in _models(c)
    r = httpx.post(
        c.base_url + "/completions",
        headers={"Authorization": "Bearer k-0123456789abcdef"},
        json={"model": "fox", "prompt": [1, 2], "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def _republish(c):
    for w in c.workers.values():
        await w.registrar.publish_now()
    await c.services.registry.wait_changed(0.5)


def test_a_refusal_rolls_the_load_back(lora_cluster):
    c = lora_cluster
    for w in c.workers.values():
        w.lora_calls.clear()
    r = _post(c, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "/adapters/bad"})
    assert r.status_code == 400 and "bad rank" in r.json()["error"]["message"]
    assert "b" not in _models(c)
    assert all(not w.loras for w in c.workers.values())
    for wid in ("d1", "d2"):  # loaded there, then unloaded again
        assert c.workers[wid].lora_calls == [("load", "b"), ("unload", "b")]


def test_runtime_updates_are_off_by_default(etcd, bg):
    c = start_cluster(bg, etcd.endpoint, "lora-off", [("decode", "d1")])
    try:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = httpx.post(
                c.router.url + path, json={"lora_name": "a", "lora_path": "/a"}, timeout=30
            )
            assert r.status_code == 404 and "--enable-lora" in r.json()["error"]["message"]
    finally:
        c.stop()
