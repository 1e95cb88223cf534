"""The engine with the Triton attention backend — and the fused RMSNorm, RoPE and SiLU-and-mul
kernels that come with it — (interpreted on CPU) gives the same greedy tokens as with the
torch backend, on a truncated model."""

from engine import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def square(x):", "Hello, my name is"]


def test_triton_backend_greedy_equals_torch_backend(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=6)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(model_dir),
            num_layers=2,
            kv_cache_memory=8 << 20,
            block_size=16,
            dtype="float32",
            attention_backend=backend,
            max_num_batched_tokens=8,
        )  # chunked: prefill+decode mixes
        assert llm.engine.backend.name == backend
        assert (llm.engine.loaded.model.kernels is not None) == (backend == "triton")
        results[backend] = [
            o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)
        ]
    assert results["triton"] == results["torch"]
