"""Speculative decoding in the engine: output with speculation is token for token what the
engine produces without it (greedy and seeded random, every stop rule, chunked prefill,
preemption, prefix caching), for the n-gram proposer, a layer-skip self-draft and a separate
draft model; no block is held for rejected drafts; bad configs fail at start."""

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.checks import FieldError
from engine.config import EngineConfig

NUM_LAYERS = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
SELF_DRAFT = {"method": "draft_model", "model": "self:2", "num_speculative_tokens": 3}
DRAFT_LAYERS = 2  # the separate draft model: cheaper than the target, as drafts are meant to be
REPEATING = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The "
    "quick",
    "Copy this list: red, green, blue, yellow, purple, orange. Again: red, green, blue,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
]
FREE = ["Hi", "Once upon a time, in a small village by the sea,", "The capital of France is"]
PROMPTS = REPEATING + FREE


def _llm(model_dir, spec=None, **engine_args):
    engine_args.setdefault("kv_cache_memory", 64 << 20)
    return LLM(
        str(model_dir),
        num_layers=NUM_LAYERS,
        dtype="float32",
        speculative_config=spec,
        **engine_args,
    )


class _Logprobs(list):
    """Logprob values compared to 1e-4: a verify pass computes a position in a multi-token
    query where plain decoding computes it alone, so the last float bits may differ."""

    def __eq__(self, other):
        return len(self) == len(other) and all(abs(a - b) < 1e-4 for a, b in zip(self, other))


def _outputs(llm, prompts, params):
    return [
        (
            c.token_ids,
            c.text,
            c.finish_reason,
            c.stop_reason,
            _Logprobs(lp.logprob for lp in c.logprobs),
        )
        for o in llm.generate(prompts, params, use_tqdm=False)
        for c in o.outputs
    ]


@pytest.fixture(scope="module")
def reference(model_dir):
    return _llm(model_dir)


@pytest.fixture(scope="module")
def draft_dir(model_dir, tmp_path_factory):
    """A separate draft model: the default model's first DRAFT_LAYERS layers as a directory of
    its own (its config says so; the weights file is the same, layers past it are skipped)."""
    out = tmp_path_factory.mktemp("draft")
    config = json.loads((model_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": DRAFT_LAYERS}))
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    return out


@pytest.fixture(scope="module", params=["ngram", "self_draft", "draft_model"])
def spec_llm(request, model_dir):
    if request.param == "draft_model":
        draft = request.getfixturevalue("draft_dir")
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    else:
        spec = {"ngram": NGRAM, "self_draft": SELF_DRAFT}[request.param]
    return _llm(model_dir, spec)


def _accepted(llm) -> int:
    return llm.engine.stats().spec_num_accepted_tokens


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
SEEDED_PROMPTS = REPEATING + FREE[:1]
SEEDED = [
    SamplingParams(
        temperature=0.9,
        top_p=0.95,
        seed=7 + i,
        max_tokens=20,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        min_tokens=5,
        logprobs=1,
    )
    for i in range(len(SEEDED_PROMPTS))
]


@pytest.fixture(scope="module")
def greedy_expected(reference):
    """The reference's outputs, computed once for every proposer."""
    return _outputs(reference, PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def seeded_expected(reference):
    return _outputs(reference, SEEDED_PROMPTS, SEEDED)


def test_greedy_output_is_identical_with_speculation(greedy_expected, spec_llm):
    before = _accepted(spec_llm)
    assert _outputs(spec_llm, PROMPTS, GREEDY) == greedy_expected
    assert _accepted(spec_llm) > before  # drafts were verified and kept, not just skipped


def test_seeded_sampling_is_identical_with_speculation(seeded_expected, spec_llm):
    assert _outputs(spec_llm, SEEDED_PROMPTS, SEEDED) == seeded_expected


def test_stop_rules_hold_at_any_acceptance_length(reference, model_dir):
    """max_tokens, stop strings, stop token ids and min_tokens cut inside a run of accepted
    drafts exactly where they cut one token at a time."""
    spec_llm = _llm(model_dir, {**NGRAM, "adaptive": False})
    prompt = REPEATING[0]
    text = reference.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False
    )[0].outputs[0]
    cases = [SamplingParams(temperature=0.0, max_tokens=m) for m in (1, 2, 3, 5, 7, 11)]
    cases += [
        SamplingParams(temperature=0.0, max_tokens=30, stop=[text.text[i : i + 4]])
        for i in (3, 9, 17)
    ]
    cases += [
        SamplingParams(
            temperature=0.0, max_tokens=30, stop=[text.text[9:13]], include_stop_str_in_output=True
        )
    ]
    cases += [
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[text.token_ids[i]])
        for i in (2, 6)
    ]
    cases += [
        SamplingParams(
            temperature=0.0, max_tokens=30, min_tokens=8, stop_token_ids=[text.token_ids[2]]
        )
    ]
    # one batch of every case (each sequence drafts, and is cut, on its own)
    ours, expected = (_outputs(llm, [prompt] * len(cases), cases) for llm in (spec_llm, reference))
    for params, a, b in zip(cases, ours, expected):
        assert a == b, params
    assert _accepted(spec_llm) > 0


@pytest.fixture(scope="module")
def reference_40(reference):
    """(prompts, params, the reference's outputs) for the engine settings below."""
    prompts = PROMPTS + [p + " Again:" for p in REPEATING]  # shared prefixes
    params = SamplingParams(temperature=0.0, max_tokens=40)
    return prompts, params, _outputs(reference, prompts, params)


@pytest.mark.parametrize(
    "engine_args",
    [
        {"max_num_batched_tokens": 8},  # chunked prefill; the budget also cuts drafts
        {"kv_cache_memory": 12 * 4 * 2 * 16 * 3 * 64 * 4, "max_num_seqs": 6},  # 12 blocks: preempts
        {"enable_prefix_caching": True},
    ],
    ids=["chunked", "preemption", "prefix_cache"],
)
def test_identical_under_chunked_prefill_preemption_and_prefix_caching(
    reference_40, model_dir, engine_args
):
    llm = _llm(model_dir, NGRAM, **engine_args)
    prompts, params, expected = reference_40
    assert _outputs(llm, prompts, params) == expected
    if "max_num_seqs" in engine_args:
        assert llm.engine.stats().num_preemptions > 0
    if engine_args.get("enable_prefix_caching"):  # again: now from the prefix cache
        assert _outputs(llm, prompts, params) == expected
        assert llm.engine.stats().prefix_cache_hits > 0


def test_no_block_is_held_for_rejected_drafts(model_dir):
    """After every step a running sequence holds exactly the blocks for its tokens (the
    slot of its next token included), even after its drafts were rejected; at the end every
    block is free."""
    llm = _llm(model_dir, {**NGRAM, "adaptive": False})
    engine, bm = llm.engine, llm.engine.block_manager
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40)  # random: many rejections
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            assert len(bm.block_table(request.request_id)) <= bm.blocks_for(request.num_tokens)
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens > 0
    assert bm.pool.num_free_blocks == bm.pool.num_blocks


def test_metrics_count_drafts_and_accepted_tokens_per_position(model_dir):
    llm = _llm(model_dir, NGRAM)
    llm.generate(REPEATING, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    draft_tokens = metrics["vllm:spec_decode_num_draft_tokens"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert len(per_pos) == NGRAM["num_speculative_tokens"] and sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # position i+1 needs position i accepted
    assert 0 < accepted <= draft_tokens <= drafts * NGRAM["num_speculative_tokens"]
    assert "vllm:spec_decode_num_drafts" not in {m.name for m in _llm(model_dir).get_metrics()}


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "num_speculative_tokens must be an integer >= 1",
        ),
        ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens"),
        (
            {"method": "eagle", "num_speculative_tokens": 2},
            "method must be one of ngram, draft_model",
        ),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3},
            "unknown keys ['lookahead']",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "must name the draft model"),
        ({"method": "draft_model", "model": "self:x", "num_speculative_tokens": 2}, "integer N"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 1,
                "prompt_lookup_min": 3,
            },
            "prompt_lookup_max must be >= prompt_lookup_min",
        ),
        ("{not json", "not JSON"),
    ],
)
def test_bad_configs_are_clear_errors_before_anything_loads(spec, message):
    with pytest.raises(FieldError, match=message.replace("[", r"\[").replace("]", r"\]")):
        EngineConfig(speculative_config=spec)


def test_self_draft_must_skip_layers(model_dir):
    with pytest.raises(FieldError, match="self:4 must use fewer layers than the target's 4"):
        _llm(model_dir, {"method": "draft_model", "model": "self:4", "num_speculative_tokens": 2})


def test_a_draft_model_with_another_vocabulary_is_refused(model_dir, tmp_path):
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    config.update(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    shapes = {
        "model.embed_tokens.weight": (1024, 64),
        "model.norm.weight": (64,),
        "model.layers.0.input_layernorm.weight": (64,),
        "model.layers.0.post_attention_layernorm.weight": (64,),
        "model.layers.0.self_attn.q_proj.weight": (64, 64),
        "model.layers.0.self_attn.k_proj.weight": (32, 64),
        "model.layers.0.self_attn.v_proj.weight": (32, 64),
        "model.layers.0.self_attn.o_proj.weight": (64, 64),
        "model.layers.0.mlp.gate_proj.weight": (128, 64),
        "model.layers.0.mlp.up_proj.weight": (128, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 128),
    }
    save_file({k: torch.zeros(v) for k, v in shapes.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(FieldError, match="another vocabulary"):
        _llm(
            model_dir,
            {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2},
        )


def test_parallel_completions_speculate_each_on_their_own(reference, model_dir):
    llm = _llm(model_dir, NGRAM)
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=20)
    assert _outputs(llm, REPEATING[:2], params) == _outputs(reference, REPEATING[:2], params)
    assert _accepted(llm) > 0
