"""`POST /v1/embeddings` through the real session cluster (router + 1 prefill + 1 decode worker,
2 layers, fp32) with the official `openai` client, against HF transformers: the last layer's
hidden state after the final norm, pooled (last token; mean as pdserve's `pooling_type`) and
L2-normalized. Embeddings run on the prefill worker only: the decode worker serves none."""

import asyncio
import base64
import struct

import httpx
import openai
import pytest
import torch
from openai_cluster import MODEL, NUM_LAYERS, WORKER_MAX_MODEL_LEN

pytestmark = pytest.mark.slow
TOL = 1e-4
TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b\n", "Hi"]


@pytest.fixture(scope="module")
def hf_embed(model_dir):
    """token ids, pooling -> the normalized HF reference vector."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(
        model_dir, num_hidden_layers=NUM_LAYERS, dtype=torch.float32
    ).eval()

    def embed(ids: list[int], pooling: str = "last") -> torch.Tensor:
        with torch.inference_mode():
            states = hf.model(torch.tensor([ids])).last_hidden_state[0]
        pooled = states[-1] if pooling == "last" else states.mean(0)
        return torch.nn.functional.normalize(pooled, dim=-1)

    return embed


def _close(got, ref: torch.Tensor) -> None:
    got = torch.tensor(got, dtype=torch.float32)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= TOL


def _ids(reference, text: str) -> list[int]:
    return reference.tokenizer.encode(text, add_special_tokens=True)


def test_single_string(client, reference, hf_embed):
    r = client.embeddings.create(model=MODEL, input=TEXTS[0])  # the client asks for base64
    ids = _ids(reference, TEXTS[0])
    assert r.object == "list" and r.model == MODEL and len(r.data) == 1
    assert r.data[0].index == 0 and r.data[0].object == "embedding"
    _close(r.data[0].embedding, hf_embed(ids))
    assert r.usage.prompt_tokens == r.usage.total_tokens == len(ids)


def test_batch_of_strings_and_float_format(client, reference, hf_embed):
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2]
    for text, d in zip(TEXTS, r.data):
        _close(d.embedding, hf_embed(_ids(reference, text)))
    assert r.usage.prompt_tokens == sum(len(_ids(reference, t)) for t in TEXTS)
    # base64 (asked for explicitly, the client leaves it encoded): little-endian float32
    # bytes of the same values (up to how the worker batched each call: row order in a
    # matmul moves the last bits).
    b64 = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    for f, b in zip(r.data, b64.data, strict=True):
        raw = base64.b64decode(b.embedding)
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(
            f.embedding, abs=1e-6
        )


def test_token_ids_and_lists_of_token_ids(client, reference, hf_embed):
    ids = [_ids(reference, t) for t in TEXTS]
    one = client.embeddings.create(model=MODEL, input=ids[1])
    _close(one.data[0].embedding, hf_embed(ids[1]))
    many = client.embeddings.create(model=MODEL, input=ids)
    for i, d in zip(ids, many.data, strict=True):
        _close(d.embedding, hf_embed(i))


def test_mean_pooling_and_prefix_cached_prompt(client, reference, hf_embed):
    long = "You answer in one short sentence and never use lists. " * 6
    ids = _ids(reference, long)
    first = client.embeddings.create(model=MODEL, input=long)
    again = client.embeddings.create(model=MODEL, input=long)  # the prefill worker's cache hit
    _close(first.data[0].embedding, hf_embed(ids))
    _close(again.data[0].embedding, hf_embed(ids))
    mean = client.embeddings.create(model=MODEL, input=long, extra_body={"pooling_type": "mean"})
    _close(mean.data[0].embedding, hf_embed(ids, "mean"))


def test_refusals(client):
    cases = [
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [10**7]}, "input"),
        ({"input": [1] * WORKER_MAX_MODEL_LEN}, "input"),
        ({"input": "x", "extra_body": {"pooling_type": "cls"}}, "pooling_type"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(model=MODEL, **kwargs)
        assert err.value.body["param"] == param, kwargs
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")


def test_decode_workers_serve_no_embeddings(e2e, client):
    client.embeddings.create(model=MODEL, input=TEXTS)

    async def workers():
        return await e2e.workers()

    served = {
        w.role: _metric(w.metrics_address, "pdserve_worker_embeddings_total")
        for w in asyncio.run(workers())
    }
    assert served["decode"] == 0 and served["prefill"] >= 3
    router = {
        role: _metric(
            e2e.url.removeprefix("http://"), "pdserve_router_embedding_placements_total", role
        )
        for role in ("prefill", "decode")
    }
    assert router["decode"] == 0 and router["prefill"] >= 3


def _metric(address: str, name: str, role: str | None = None) -> float:
    text = httpx.get(f"http://{address}/metrics", timeout=5).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and (role is None or f'role="{role}"' in line)
    ]
    assert values, f"{name} missing at {address}"
    return sum(values)
