"""Multi-LoRA in a disaggregated cluster, real processes on loopback: etcd + `pdserve prefill`
+ `pdserve decode` (both `--enable-lora`) + `pdserve router --enable-lora --api-key`.

Through the router with the openai client: an adapter loaded at run time appears in
/v1/models with its parent; a completion naming it, prefilled on the prefill worker, equals a
single engine's with that adapter; bad adapters are 4xx naming the problem and leave nothing
loaded; unloading removes it (a request for it is then vLLM's 404); the workers keep serving
and hold no KV block afterwards."""

import httpx
import openai
import pytest
from lora_adapter import make_adapter
from pd_cluster import NUM_LAYERS, metric, remote_prefill_cluster, wait_all_blocks_free

from engine import LLM, SamplingParams
from engine.lora.request import LoRARequest, lora_id_for

pytestmark = pytest.mark.slow

CLUSTER = "lora"
KEY = "lora-key-0123456789abcdef"
LORA = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--enable-admin-rpcs"]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
GREEDY = {"temperature": 0.0, "max_tokens": 12}


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "ok": make_adapter(model_dir, root / "ok", NUM_LAYERS, rank=8, seed=1),
        "big": make_adapter(model_dir, root / "big", NUM_LAYERS, rank=16, seed=2),
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    router_args = ("--local-prefill-max-tokens", "0", "--enable-lora", "--api-key", KEY)
    with remote_prefill_cluster(
        tmp_path_factory.mktemp("lora-logs"), CLUSTER, worker_args=LORA, router_args=router_args
    ) as c:
        yield c


def _post(url: str, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=120)


def test_load_serve_unload(cluster, adapters, model_dir):
    url, prefill, decode = cluster
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    base = client.models.list().data[0].id
    body = {"lora_name": "fox", "lora_path": str(adapters["ok"])}
    assert _post(url, "/v1/load_lora_adapter", body, key=None).status_code == 401
    r = _post(url, "/v1/load_lora_adapter", body)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'fox' added successfully."
    cards = {m.id: m for m in client.models.list().data}
    assert cards["fox"].parent == base and cards["fox"].root == str(adapters["ok"])
    assert client.models.retrieve("fox").parent == base
    r = _post(url, "/v1/load_lora_adapter", body)
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]

    ref = LLM(
        str(model_dir),
        num_layers=NUM_LAYERS,
        kv_cache_memory=32 << 20,
        dtype="float32",
        enable_lora=True,
        max_lora_rank=8,
    )
    lora = LoRARequest("fox", lora_id_for("fox"), str(adapters["ok"]))
    ids = ref.tokenizer.encode(PROMPT, add_special_tokens=True)
    [with_lora, without] = [
        o.outputs[0].text
        for o in ref.generate(
            [ids, ids], SamplingParams(**GREEDY), lora_request=[lora, None], use_tqdm=False
        )
    ]
    assert with_lora != without  # the adapter changes the output
    remote_before = metric(
        decode.metrics_address, "pdserve_worker_prefill_mode_total", mode="remote"
    )
    got = client.completions.create(model="fox", prompt=ids, **GREEDY)
    assert got.model == "fox" and got.choices[0].text == with_lora
    assert client.completions.create(model=base, prompt=ids, **GREEDY).choices[0].text == without
    assert (
        metric(decode.metrics_address, "pdserve_worker_prefill_mode_total", mode="remote")
        >= remote_before + 2
    )  # prefilled on the prefill worker

    r = _post(url, "/v1/unload_lora_adapter", {"lora_name": "fox"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'fox' removed successfully."
    assert "fox" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="fox", prompt=ids, **GREEDY)
    r = _post(url, "/v1/unload_lora_adapter", {"lora_name": "fox"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    for worker in (prefill, decode):
        wait_all_blocks_free(worker.address)


def test_bad_adapters_are_4xx_and_load_nothing(cluster, adapters, tmp_path):
    url, prefill, decode = cluster
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    r = _post(
        url, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(tmp_path / "no")}
    )
    assert r.status_code == 404 and "No adapter found" in r.json()["error"]["message"], r.text
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(adapters["big"])})
    assert r.status_code == 400 and "rank" in r.json()["error"]["message"], r.text
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and "lora_path" in r.json()["error"]["message"]
    (tmp_path / "empty").mkdir()
    r = _post(
        url, "/v1/load_lora_adapter", {"lora_name": "empty", "lora_path": str(tmp_path / "empty")}
    )
    assert r.status_code == 400, r.text
    assert {m.id for m in client.models.list().data} == {client.models.list().data[0].id}
    for worker in (prefill, decode):
        assert prefill.alive() and decode.alive()
        wait_all_blocks_free(worker.address)
