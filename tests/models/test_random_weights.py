"""engine/models/random_weights: a random-weight copy of the bundled model's shape loads in
our engine and in transformers alike, gives the same greedy tokens in both, and is a pure
function of its seed."""

import json

import torch
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from engine.models.random_weights import main, write_random_model
from engine.processing.tokenizer import Tokenizer

PROMPTS = ["The capital of France is", "def add(a, b):", "1, 2, 3,"]


def test_same_greedy_tokens_as_transformers(model_dir, tmp_path):
    from transformers import LlamaForCausalLM

    out = write_random_model(model_dir, tmp_path / "random", seed=3, num_layers=2)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    llm = LLM(str(out), kv_cache_memory=32 << 20, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    hf = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = Tokenizer.from_dir(out)
    for prompt, tokens in zip(PROMPTS, ours):
        ids = tok.encode(prompt)
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        ref_tokens = ref[0, len(ids) :].tolist()
        eos = hf.generation_config.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
        if eos_ids & set(ref_tokens):  # transformers stops (and pads) there; the engine ran on
            ref_tokens = ref_tokens[
                : min(ref_tokens.index(e) for e in eos_ids & set(ref_tokens)) + 1
            ]
        assert tokens[: len(ref_tokens)] == ref_tokens, prompt
    # Random weights are not the real ones: the text differs from the bundled model's.
    real = LLM(str(model_dir), num_layers=2, kv_cache_memory=32 << 20, dtype="float32")
    assert [o.outputs[0].token_ids for o in real.generate(PROMPTS, params, use_tqdm=False)] != ours


def test_a_pure_function_of_the_seed(model_dir, tmp_path):
    main([str(tmp_path / "a"), "--source", str(model_dir), "--num-layers", "1", "--seed", "7"])
    main([str(tmp_path / "b"), "--source", str(model_dir), "--num-layers", "1", "--seed", "7"])
    main([str(tmp_path / "c"), "--source", str(model_dir), "--num-layers", "1", "--seed", "8"])
    a, b, c = (load_file(str(tmp_path / d / "model.safetensors")) for d in "abc")
    assert a.keys() == b.keys() == c.keys() and "model.layers.0.mlp.down_proj.weight" in a
    assert "model.layers.1.input_layernorm.weight" not in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (model_dir / name).read_bytes()
