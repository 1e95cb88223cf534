"""Multi-LoRA in the engine against references: greedy output for each adapter equals peft's
on the HF model and the HF model with the adapter merged into its weights (W + scale BA); a
batch mixing adapters and the base model equals each run alone; adapters never share KV
blocks; at most max_loras adapters per step; bad adapters are clear errors."""

import json

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.lora.adapter import LoRAError

NUM_LAYERS = 4
MAX_TOKENS = 12
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time"]
ADAPTERS = {  # name -> (rank, target modules, rsLoRA)
    "qv_down": (8, ["q_proj", "v_proj", "down_proj"], False),
    "everything": (
        16,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        False,
    ),
    "mlp_rs": (4, ["o_proj", "gate_proj", "up_proj"], True),
}


def _hf(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(
        model_dir, num_hidden_layers=NUM_LAYERS, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """name -> (LoRARequest, peft model): random adapters saved in PEFT format."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("loras")
    out = {}
    for i, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(i)
        model = get_peft_model(
            _hf(model_dir),
            LoraConfig(
                r=rank,
                lora_alpha=2 * rank,
                target_modules=targets,
                use_rslora=rslora,
                init_lora_weights=False,
            ),
        )
        for param_name, p in model.named_parameters():
            if "lora_" in param_name:
                p.data.normal_(0, 0.08)  # strong enough to change greedy output
        model.save_pretrained(root / name)
        out[name] = (LoRARequest(name, i + 1, str(root / name)), model.eval())
    return out


def _llm(model_dir, **kw):
    kw.setdefault("kv_cache_memory", 64 << 20)
    kw.setdefault("max_lora_rank", 16)
    return LLM(str(model_dir), num_layers=NUM_LAYERS, dtype="float32", enable_lora=True, **kw)


def _hf_greedy(model, tokenizer, prompt):
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(ids) :].tolist()


def _greedy(llm, prompts, lora):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
    ]


def test_each_adapter_matches_peft_and_merged_weights(model_dir, adapters):
    llm = _llm(model_dir, max_loras=3)
    prompts = PROMPTS + [" ".join(PROMPTS * 8)]  # its prefill step has > 64 rows: grouped path
    base = _greedy(llm, prompts, None)
    for name, (lora, peft_model) in adapters.items():
        ours = _greedy(llm, prompts, lora)
        assert ours == [_hf_greedy(peft_model, llm.tokenizer, p) for p in prompts], name
        assert ours != base, name  # the adapter changes the output
    lora, peft_model = adapters["everything"]
    merged = peft_model.merge_and_unload()  # W + scale * B A, a plain HF model
    assert _greedy(llm, PROMPTS, lora) == [_hf_greedy(merged, llm.tokenizer, p) for p in PROMPTS]


def test_a_mixed_batch_equals_each_run_alone(model_dir, adapters):
    llm = _llm(model_dir, max_loras=3)
    loras = [adapters[n][0] for n in ADAPTERS] + [None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    prompts[0] = " ".join([prompts[0]] * 20)  # > 64 rows in the first step: the grouped path
    alone = [_greedy(llm, [p], lora)[0] for p, lora in zip(prompts, loras)]
    assert _greedy(llm, prompts, loras) == alone


def test_more_adapters_than_slots_are_held_back_not_mixed_up(model_dir, adapters):
    llm = _llm(model_dir, max_loras=1, max_cpu_loras=2)
    loras = [adapters[n][0] for n in ADAPTERS] * 2
    prompts = [PROMPTS[0]] * len(loras)
    seen = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule(inputs):
        out = schedule(inputs)
        seen.append({r.lora.lora_int_id for r, _ in out.scheduled if r.lora is not None})
        return out

    llm.engine.scheduler.schedule = recording_schedule
    mixed = _greedy(llm, prompts, loras)
    assert max(len(s) for s in seen) == 1  # never two adapters in one step
    reference = _llm(model_dir, max_loras=3)
    assert mixed == [_greedy(reference, [p], lora)[0] for p, lora in zip(prompts, loras)]


def test_adapters_never_share_kv_blocks(model_dir, adapters):
    llm = _llm(model_dir, max_loras=2)
    prompt = " ".join(["shared prefix words"] * 20)  # several full blocks
    a, b = adapters["qv_down"][0], adapters["everything"][0]
    engine = llm.engine
    ra = engine.make_request("a", prompt, SamplingParams(max_tokens=1), lora_request=a)
    rb = engine.make_request("b", prompt, SamplingParams(max_tokens=1), lora_request=b)
    rbase = engine.make_request("base", prompt, SamplingParams(max_tokens=1))
    assert not set(ra.block_hashes) & set(rb.block_hashes)
    assert not set(ra.block_hashes) & set(rbase.block_hashes)
    llm.generate(prompt, SamplingParams(max_tokens=1), lora_request=a, use_tqdm=False)
    hits = engine.stats().prefix_cache_hits
    llm.generate(prompt, SamplingParams(max_tokens=1), lora_request=b, use_tqdm=False)
    assert engine.stats().prefix_cache_hits == hits  # another adapter: no hit
    llm.generate(prompt, SamplingParams(max_tokens=1), lora_request=a, use_tqdm=False)
    assert engine.stats().prefix_cache_hits > hits  # the same adapter: hit


def test_bad_adapters_are_clear_errors(model_dir, adapters, tmp_path):
    llm = _llm(model_dir, max_lora_rank=8)
    with pytest.raises(LoRAError, match="rank 16 is above max_lora_rank 8"):
        llm.engine.make_request("r", "hi", SamplingParams(), lora_request=adapters["everything"][0])
    with pytest.raises(LoRAError, match="needs adapter_config.json"):
        llm.engine.make_request(
            "r",
            "hi",
            SamplingParams(),
            lora_request=LoRARequest("missing", 9, str(tmp_path / "nope")),
        )
    # An adapter for another base model: wrong shapes.
    from safetensors.torch import save_file

    bad = tmp_path / "other_base"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    save_file(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 100),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(576, 4),
        },
        str(bad / "adapter_model.safetensors"),
    )
    with pytest.raises(LoRAError, match=r"q_proj has A \(4, 100\).*needs A \(4, 576\)"):
        llm.engine.make_request(
            "r", "hi", SamplingParams(), lora_request=LoRARequest("o", 10, str(bad))
        )
    plain = LLM(str(model_dir), num_layers=NUM_LAYERS, dtype="float32", kv_cache_memory=16 << 20)
    with pytest.raises(LoRAError, match="LoRA is not enabled"):
        plain.engine.make_request("r", "hi", SamplingParams(), lora_request=adapters["qv_down"][0])
    assert not llm.engine.has_unfinished_requests()


def test_lora_modules_load_at_start_and_remove_lora_forgets(model_dir, adapters):
    lora = adapters["qv_down"][0]
    llm = _llm(model_dir, lora_modules=(f"named={lora.lora_path}",))
    assert [r.lora_name for r in llm.engine.list_loras()] == ["named"]
    ours = _greedy(
        llm,
        PROMPTS[:1],
        LoRARequest("named", llm.engine.list_loras()[0].lora_int_id, lora.lora_path),
    )
    assert ours == _greedy(llm, PROMPTS[:1], lora)
    assert llm.engine.remove_lora(lora.lora_int_id)
    assert lora.lora_int_id not in {r.lora_int_id for r in llm.engine.list_loras()}


def test_triton_kernels_path_equals_the_torch_path(model_dir, adapters):
    """The fused-kernel path (Triton backend; the interpreter here) over a mixed batch."""
    loras = [adapters["qv_down"][0], adapters["everything"][0], None]
    outputs = []
    for backend in ("torch", "triton"):
        llm = LLM(
            str(model_dir),
            num_layers=2,
            dtype="float32",
            kv_cache_memory=8 << 20,
            attention_backend=backend,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=16,
        )
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        outputs.append(
            [
                o.outputs[0].token_ids
                for o in llm.generate(PROMPTS, params, lora_request=loras, use_tqdm=False)
            ]
        )
    assert outputs[0] == outputs[1]
