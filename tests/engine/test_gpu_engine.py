"""On CUDA (skipped elsewhere): the whole engine with the Triton backend gives the same greedy
tokens as with the torch backend and as transformers' generate(), in fp32 and at full depth,
through chunked prefill, a shared prefix and a mixed batch, with its decode steps replayed
from CUDA graphs (the default) and eagerly; and the KV pool is sized from
`gpu_memory_utilization`.

The model is $PDSERVE_GPU_MODEL when set (tools/gpu/gpu_check writes a random-weight copy
of the default model's shape there: the GPU machine has no network and cannot carry the real
weights), else the bundled default model."""

import gc
import os
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

MAX_TOKENS = 24
SHARED = "You are a careful assistant. Answer briefly and precisely. The user asks: "


@pytest.fixture(scope="module")
def gpu_model() -> Path:
    path = os.environ.get("PDSERVE_GPU_MODEL")
    if path:
        return Path(path)
    from engine.models.prepare import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def prompts(gpu_model) -> list[list[int]]:
    """Short and long prompts (a 1,500-token one crosses three 512-token prefill chunks) and
    three that share a prefix, as token ids."""
    from engine.processing.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(gpu_model)
    texts = [
        "Hi",
        "The capital of France is",
        "def add(a, b):\n    return",
        *(SHARED + q for q in ("What is 2+2?", "Name a color.", "Who wrote Hamlet?")),
    ]
    ids = [tok.encode(t) for t in texts]
    long = (tok.encode("Once upon a time, in a small village by the sea, ") * 200)[:1500]
    return ids + [long]


def until_eos(tokens: list[int], eos: int | list[int] | None) -> list[int]:
    """`tokens` up to and including the first EOS (transformers pads after it)."""
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens


def _free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _greedy(
    model: Path, prompts, backend: str, dtype: str = "float32", graphs: list | None = None, **kw
) -> list[list[int]]:
    """`graphs`: gets the engine's CUDA graphs' (captured sizes, disabled reason) appended."""
    llm = LLM(
        str(model),
        device="cuda",
        dtype=dtype,
        attention_backend=backend,
        kv_cache_memory=1 << 30,
        max_num_batched_tokens=512,
        **kw,
    )
    assert llm.engine.backend.name == backend
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    if graphs is not None:
        decode_graphs = llm.engine.runner.graphs
        graphs.append(decode_graphs and (decode_graphs.captured, decode_graphs.disabled))
    del llm
    _free_cuda()
    return out


@pytest.fixture(scope="module")
def triton_tokens(gpu_model, prompts):
    return _greedy(gpu_model, prompts, "triton")


def test_cuda_graph_decode_equals_eager(gpu_model, prompts, triton_tokens):
    """The default (CUDA graphs for decode steps) == enforce_eager, and graphs were replayed:
    seven prompts decode together (size 8), the long one alone at the end (size 1); its
    chunks and the steps they share run eagerly."""
    graphs: list = []
    assert (
        _greedy(gpu_model, prompts, "triton", cuda_graph_sizes=[1, 8], graphs=graphs)
        == triton_tokens
    )
    ((captured, disabled),) = graphs
    assert disabled is None and 8 in captured and set(captured) <= {1, 8}
    assert _greedy(gpu_model, prompts, "triton", enforce_eager=True, graphs=graphs) == triton_tokens
    assert graphs[1] is None


def test_triton_backend_equals_torch_backend(gpu_model, prompts, triton_tokens):
    assert triton_tokens == _greedy(gpu_model, prompts, "torch")


def test_triton_backend_equals_transformers(gpu_model, prompts, triton_tokens):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(gpu_model, dtype=torch.float32).cuda().eval()
    try:
        for ids, ours in zip(prompts, triton_tokens):
            with torch.inference_mode():
                ref = hf.generate(
                    torch.tensor([ids], device="cuda"), max_new_tokens=MAX_TOKENS, do_sample=False
                )
            ref_tokens = until_eos(ref[0, len(ids) :].tolist(), hf.generation_config.eos_token_id)
            # transformers stops at EOS; the engine ran on (ignore_eos): compare up to there.
            assert ours[: len(ref_tokens)] == ref_tokens, f"prompt of {len(ids)} tokens"
    finally:
        del hf
        _free_cuda()


def test_kv_pool_sized_from_gpu_memory_utilization(gpu_model):
    """budget = utilization x total - the profiled forward's peak (weights included)."""
    from engine.kv.kv_pool import kv_block_bytes

    _free_cuda()
    total = torch.cuda.get_device_properties(0).total_memory
    llm = LLM(str(gpu_model), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.2)
    engine = llm.engine
    pool = engine.kv_cache
    assert pool.is_cuda and pool.shape[0] == engine.block_manager.pool.num_blocks
    block = kv_block_bytes(engine.loaded.args, engine.config.block_size, torch.bfloat16)
    pool_bytes = pool.numel() * pool.element_size()
    assert pool_bytes == pool.shape[0] * block
    # The pool plus what the process already holds stays within the fraction asked for, and
    # fills it to within the profiled peak's estimate (weights + activations < 2 GiB here).
    assert torch.cuda.memory_allocated() <= 0.2 * total + block
    assert pool_bytes >= 0.2 * total - (2 << 30)
    out = llm.generate(
        ["Hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4
    del llm, engine, pool
    _free_cuda()
