"""Speculative decoding in a disaggregated cluster, real processes on loopback: etcd +
`pdserve prefill` + `pdserve decode --speculative-config` (ngram) + `pdserve router`.

Completions of copy-heavy prompts through the router (prefilled on the prefill worker, KV over
NIXL, decoded with drafts) equal a single engine's without speculation, greedy and seeded; the
decode worker counts drafts and accepted tokens under vLLM's names; the prefill worker, given
the same flag (as `--worker-arg` gives it to both roles), drops it with one warning."""

import json
import time

import httpx
import pytest
from metrics_catalog import documented, speculative_only, type_lines
from pd_cluster import NUM_LAYERS, metric, remote_prefill_cluster

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

CLUSTER = "spec-decode"
MODEL = "SmolLM2-135M-Instruct"
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
TEXTS = [
    "The cat sat on the mat. " * 4,
    "Roses are red, violets are blue, sugar is sweet and so are you. " * 3,
]
GREEDY = {"temperature": 0.0, "max_tokens": 32}
SEEDED = {"temperature": 0.8, "seed": 1234, "max_tokens": 32}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with remote_prefill_cluster(
        tmp_path_factory.mktemp("spec-logs"), CLUSTER, worker_args=("--speculative-config", SPEC)
    ) as c:
        yield c


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same model without speculation: what the cluster must produce."""
    return LLM(str(model_dir), num_layers=NUM_LAYERS, kv_cache_memory=32 << 20, dtype="float32")


def _complete(url: str, prompt: list[int], sampling: dict) -> str:
    r = httpx.post(
        url + "/v1/completions", timeout=120, json={"model": MODEL, "prompt": prompt, **sampling}
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_outputs_equal_a_single_engine_without_speculation(cluster, reference):
    url, prefill, decode = cluster
    prompts = [reference.tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    for sampling in (GREEDY, SEEDED):
        expected = [
            o.outputs[0].text
            for o in reference.generate(prompts, SamplingParams(**sampling), use_tqdm=False)
        ]
        assert [_complete(url, p, sampling) for p in prompts] == expected, sampling
    # the prompts were prefilled remotely, so drafting started from KV that came over NIXL
    assert metric(decode.metrics_address, "pdserve_worker_prefill_mode_total", mode="remote") > 0


def test_decode_worker_counts_drafts_under_vllm_names(cluster, reference):
    url, prefill, decode = cluster
    _complete(url, reference.tokenizer.encode(TEXTS[0], add_special_tokens=True), GREEDY)
    address = decode.metrics_address
    deadline = time.monotonic() + 10  # engine stats are refreshed every 0.2 s
    while metric(address, "vllm:spec_decode_num_accepted_tokens_total") == 0:
        assert time.monotonic() < deadline, "no accepted draft tokens counted"
        time.sleep(0.2)
    # ...and until the snapshot holds still: the reads below must see one state, not the
    # request's last steps landing between them.
    previous = None
    while (now := metric(address, "vllm:spec_decode_num_draft_tokens_total")) != previous:
        assert time.monotonic() < deadline + 10, "draft counters never settled"
        previous = now
        time.sleep(0.6)
    text = httpx.get(f"http://{address}/metrics", timeout=5).text
    types = type_lines(text)
    spec_rows = {n: t for n, (t, _) in documented().items() if speculative_only(n)}
    assert {n: types.get(n) for n in spec_rows} == spec_rows
    drafted = metric(address, "vllm:spec_decode_num_draft_tokens_total", role="decode")
    accepted = metric(address, "vllm:spec_decode_num_accepted_tokens_total", role="decode")
    drafts = metric(address, "vllm:spec_decode_num_drafts_total", role="decode")
    assert drafted >= accepted > 0 and drafts > 0
    assert drafted <= 3 * drafts  # at most num_speculative_tokens per draft
    per_pos = [
        metric(address, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(3)
    ]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2]
    assert metric(address, "pdserve_worker_spec_accepted_tokens_total", role="decode") == accepted


def test_prefill_worker_drops_the_speculative_config(cluster):
    url, prefill, decode = cluster
    text = httpx.get(f"http://{prefill.metrics_address}/metrics", timeout=5).text
    assert not [n for n in type_lines(text) if speculative_only(n)]
    log = prefill.log_path.read_text()
    assert log.count("ignoring --speculative-config") == 1, log[-2000:]
