"""Sampling behaviour through the whole engine (2-layer model: fast, still a real model)."""

import math

import pytest
import torch

from engine import LLM, SamplingParams, cpu_kernels
from engine.core.limits import RequestRejected
from engine.core.request import Request
from engine.sampling.sample_row import SampleRow
from engine.sampling.sampler import Sampler, draw_keys, draw_seed, row_uniforms

PROMPTS = ["The weather today is", "My favourite food is", "In the beginning", "Dear diary,"]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_layers=2, kv_cache_memory=32 << 20)


def _texts(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12)
    alone = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    again = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    unseeded = SamplingParams(temperature=1.0, max_tokens=12)
    batched = llm.generate(
        PROMPTS[1:3] + PROMPTS[:1] + PROMPTS[3:],
        [unseeded] * 2 + [params] + [unseeded],
        use_tqdm=False,
    )
    assert _texts(alone) == _texts(again) == [_texts(batched)[2]]
    other_seed = llm.generate(
        PROMPTS[:1], SamplingParams(temperature=1.0, seed=99, max_tokens=12), use_tqdm=False
    )
    assert _texts(other_seed) != _texts(alone)


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    top1 = llm.generate(
        PROMPTS, SamplingParams(temperature=0.8, top_k=1, seed=5, max_tokens=8), use_tqdm=False
    )
    assert _texts(greedy) == _texts(top1)


def test_n_completions_share_the_prompt_and_differ(llm):
    [out] = llm.generate(
        PROMPTS[:1], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10), use_tqdm=False
    )
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Completion i equals what a seeded n=1 request would draw for index 0 only for i == 0.
    [single] = llm.generate(
        PROMPTS[:1], SamplingParams(temperature=1.0, seed=7, max_tokens=10), use_tqdm=False
    )
    assert single.outputs[0].token_ids == out.outputs[0].token_ids


def test_max_tokens_stop_token_ids_and_ignore_eos(llm):
    [out] = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 5 and out.outputs[0].finish_reason == "length"
    [stopped] = llm.generate(
        PROMPTS[:1],
        SamplingParams(temperature=0, max_tokens=5, stop_token_ids=(tokens[2],)),
        use_tqdm=False,
    )
    first = tokens.index(tokens[2])
    assert stopped.outputs[0].token_ids == tokens[: first + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    eos = llm.tokenizer.eos_token_id
    [forced] = llm.generate(
        [[1, 2]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    assert len(forced.outputs[0].token_ids) == 20  # eos (if drawn) did not stop it
    assert eos in llm.engine.tokenizer.stop_token_ids


def test_stop_strings_cut_the_text(llm):
    [full] = llm.generate(
        PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False
    )
    text = full.outputs[0].text
    stop = text[5:8]
    [cut] = llm.generate(
        PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=20, stop=[stop]), use_tqdm=False
    )
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop"


def test_presence_penalty_prevents_repeats(llm):
    prompt = "the the the the the the the the"
    [plain] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    [penalised] = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0,
            max_tokens=12,
            presence_penalty=2.0,
            frequency_penalty=2.0,
            repetition_penalty=1.5,
        ),
        use_tqdm=False,
    )
    ids = penalised.outputs[0].token_ids
    assert len(set(plain.outputs[0].token_ids)) < len(plain.outputs[0].token_ids)  # repeats
    assert len(set(ids)) == len(ids)  # penalised: no output token repeats
    assert not set(ids) & set(llm.tokenizer.encode(prompt))  # nor echoes the prompt


def _row(params: SamplingParams, output=(), prompt=(3,)) -> SampleRow:
    r = Request(
        "r",
        list(prompt),
        params,
        seed=params.seed or 0,
        eos_token_ids=frozenset(),
        max_tokens=10,
        block_hashes=[],
    )
    for t in output:
        r.append_token(t)
    return SampleRow(r, 0)


def test_sampler_filters_against_a_hand_computed_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.10]]))
    # top_p=0.7 keeps {0, 1}; min_p=0.4 keeps {0, 1} too (0.25 >= 0.2); top_k=1 keeps {0}.
    for params, allowed in [
        (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),
        (SamplingParams(temperature=1.0, min_p=0.4), {0, 1}),
        (SamplingParams(temperature=1.0, top_k=3), {0, 1, 2}),
    ]:
        seen = set()
        for seed in range(200):
            row = _row(SamplingParams(**{**params.__dict__, "seed": seed}))
            seen.add(Sampler().sample(logits.clone(), [row])[0].token_id)
        assert seen == allowed, params


def test_sampler_frequency_and_repetition_penalties_match_their_formulas():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    row = _row(
        SamplingParams(
            temperature=0.0,
            frequency_penalty=1.0,
            presence_penalty=0.5,
            repetition_penalty=2.0,
            logprobs=4,
        ),
        output=[0, 0, 2],
    )
    from engine.sampling.penalties import Penalties

    out = logits.clone()
    Penalties().apply(out, [row])
    # token 0: output twice: 2/2 - (2*1 + 0.5); token 2: -1*2 - (1 + 0.5);
    # token 3: prompt only: 0.5/2; token 1: untouched
    assert out.tolist() == [[2 / 2 - 2.5, 1.0, -1.0 * 2 - 1.5, 0.5 / 2]]
    token = Sampler().sample(logits.clone(), [row])[0]
    assert token.token_id == 1
    assert token.logprob == pytest.approx(
        math.log(torch.softmax(logits[0], -1)[1].item()), abs=1e-6
    )


def test_draw_seed_spreads_and_is_deterministic():
    seeds = {draw_seed(1, i, p) for i in range(4) for p in range(256)}
    assert len(seeds) == 1024 and all(0 <= s < 2**63 for s in seeds)
    assert draw_seed(1, 0, 0) == draw_seed(1, 0, 0)


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ toolchain for the CPU kernels")
def test_kernel_uniforms_are_row_uniforms():
    """The kernels' uniforms (`first_uniforms` over `draw_keys`, what plain draws use) are
    `row_uniforms`' first, rounded to float32: negative and 64-bit seeds included."""
    rows = []
    for i, seed in enumerate((0, 1, -5, 2**63 + 12345, 2**64 - 1, 987654321987654321, 7)):
        request = Request(
            f"seeds-{i}",
            [3, 4],
            SamplingParams(),
            seed=seed,
            eos_token_ids=frozenset(),
            max_tokens=64,
            block_hashes=[],
        )
        for t in range(i):
            request.append_token(t)
        rows.append(SampleRow(request, i % 3))
    want = torch.from_numpy(row_uniforms(rows)[:, 0].astype("float32"))
    assert torch.equal(cpu_kernels.first_uniforms(draw_keys(rows)), want)


def test_bad_requests_get_clear_errors_and_leak_nothing(llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 49152\)"):
        llm.generate([[1, 99999]], use_tqdm=False)
    with pytest.raises(RequestRejected, match="maximum context length"):
        llm.engine.add_request("too-long", [1] * 9000)
    assert not llm.engine.has_unfinished_requests()


def test_abort_frees_blocks_mid_generation(llm):
    engine = llm.engine
    engine.add_request(
        "to-abort", PROMPTS[0], SamplingParams(n=2, max_tokens=50, temperature=1.0, seed=1)
    )
    engine.step()
    engine.step()
    assert engine.stats().num_running == 2
    engine.abort_request("to-abort")
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
