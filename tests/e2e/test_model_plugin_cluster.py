"""An out-of-tree architecture served by a disaggregated cluster, real processes on loopback:
etcd + `pdserve prefill` + `pdserve decode` + `pdserve router`, all on a checkpoint of the
example plugin `TinyForCausalLM` (examples/tiny_arch).

The workers learn the architecture the way an installed plugin is learnt: their PYTHONPATH
holds the example package and a dist-info declaring its `pdserve.model_plugins` entry point
(what `pip install examples/tiny_arch` leaves), so the registry's entry-point scan registers
it — nothing in the worker command names the plugin. Completions through the router (prefilled
on the prefill worker, KV over NIXL into the decode worker's pool) equal the offline engine's
and the example's own plain-torch reference."""

import os
import sys

import httpx
import pytest
from pd_cluster import metric, remote_prefill_cluster

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from tiny_plugin import EXAMPLE_ROOT, write_entry_point_dist  # noqa: E402

pytestmark = pytest.mark.slow

CLUSTER = "model-plugin"
TEXTS = [
    "The quick brown fox jumps over the lazy dog, again and again and again.",
    "Paged attention stores keys and values in fixed-size blocks of the pool.",
]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model_dir):
    sys.path.insert(0, str(EXAMPLE_ROOT))
    from tiny_arch.make_checkpoint import make_checkpoint

    return make_checkpoint(
        tmp_path_factory.mktemp("plugin") / "tiny-ckpt", layers=2, seed=1, tokenizer_dir=model_dir
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, checkpoint):
    logs = tmp_path_factory.mktemp("plugin-logs")
    site = write_entry_point_dist(tmp_path_factory.mktemp("plugin-site"))
    path = os.pathsep.join(
        filter(None, [str(site), str(EXAMPLE_ROOT), os.environ.get("PYTHONPATH")])
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", path)  # read by the processes started below
        model = ("--model", str(checkpoint))
        with remote_prefill_cluster(logs, CLUSTER, worker_args=model, router_args=model) as c:
            yield c


def test_plugin_architecture_through_the_cluster_equals_offline(cluster, checkpoint):
    from tiny_arch import register
    from tiny_arch.reference import reference_greedy

    from engine import LLM, SamplingParams
    from engine.models.registry import ModelRegistry

    url, prefill, decode = cluster
    register()  # this process: registered directly (the workers found the entry point)
    assert ModelRegistry.is_supported("TinyForCausalLM")
    llm = LLM(str(checkpoint), dtype="float32", kv_cache_memory=8 << 20)
    prompts = [llm.tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    offline = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    model = llm.engine.loaded.model
    for prompt, out in zip(prompts, offline):
        assert list(out.outputs[0].token_ids) == reference_greedy(
            model, prompt, GREEDY["max_tokens"]
        )
        r = httpx.post(
            url + "/v1/completions",
            timeout=120,
            json={"model": checkpoint.name, "prompt": prompt, **GREEDY},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == out.outputs[0].text
    # the prompts were prefilled remotely: the plugin's KV went over NIXL into the decode pool
    assert metric(decode.metrics_address, "pdserve_worker_prefill_mode_total", mode="remote") >= 2
