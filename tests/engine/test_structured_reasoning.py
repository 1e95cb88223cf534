"""Structured outputs after a reasoning model's thinking (engine/structured/gate.py), in the
engine: the grammar binds only the output after the end marker.

The markers are token ids this 4-layer model emits on its own: the start marker ends the
prompt, and the end marker is a two-token sequence taken from the request's unconstrained
output (greedy, or seeded: draws depend on (seed, position) only). So a gated request must
reproduce that output up to and including the marker (nothing is masked while it thinks)
and then answer with one of the choices. A prompt that already closed the thinking is
constrained from its first token. Forks, speculation (drafts cross the marker), preemption,
resume at every seam and the P/D path give the same tokens."""

from dataclasses import dataclass, replace

import pytest

from decode_node.prefill_client import _for_prefill
from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.processing.tokens import Resume, SampledToken
from engine.structured.params import StructuredOutputsParams

NUM_LAYERS = 4
CHOICES = ("yes", "no", "maybe")
PROMPT = "Is the sky blue? Think first."
BASE = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=40),
    "seeded": SamplingParams(temperature=1.0, seed=7, max_tokens=40),
}


def _llm(model_dir, **engine_args):
    engine_args.setdefault("kv_cache_memory", 64 << 20)
    return LLM(str(model_dir), num_layers=NUM_LAYERS, dtype="float32", **engine_args)


@pytest.fixture(scope="module")
def llm(model_dir):
    return _llm(model_dir)


@dataclass
class Case:
    prompt: list[int]  # ends with the start marker: the output begins by thinking
    params: SamplingParams  # the choice constraint behind the markers
    thinking: list[int]  # the unconstrained output up to and including the end marker

    @property
    def constraint(self) -> StructuredOutputsParams:
        return self.params.structured_outputs


@pytest.fixture(scope="module", params=sorted(BASE))
def case(request, llm) -> Case:
    base = BASE[request.param]
    start = llm.tokenizer.encode("<think>")
    prompt = llm.tokenizer.encode(PROMPT, add_special_tokens=True) + start
    plain = _output(llm, prompt, base).token_ids
    end, answer_at = _end_marker(plain)
    so = StructuredOutputsParams(choice=CHOICES, reasoning_start=start, reasoning_end=end)
    return Case(prompt, replace(base, structured_outputs=so), plain[:answer_at])


def _end_marker(plain: list[int], first: int = 6) -> tuple[tuple[int, ...], int]:
    """A two-token sequence of `plain` at `first` or later that does not occur before: (it,
    the position after it)."""
    for i in range(first, len(plain) - 1):
        if all(plain[j : j + 2] != plain[i : i + 2] for j in range(i)):
            return tuple(plain[i : i + 2]), i + 2
    pytest.fail(f"no new two-token sequence in {plain}")


def _group(llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs


def _output(llm, prompt, params):
    return _group(llm, prompt, params)[0]


def _answer(llm, case: Case, tokens: list[int]) -> str:
    assert tokens[: len(case.thinking)] == case.thinking  # nothing masked while it thinks
    return llm.tokenizer.decode(tokens[len(case.thinking) :], skip_special_tokens=True)


def test_the_grammar_binds_the_answer_only(llm, case):
    out = _output(llm, case.prompt, case.params)
    assert out.finish_reason == "stop" and _answer(llm, case, out.token_ids) in CHOICES
    ungated = replace(case.params, structured_outputs=StructuredOutputsParams(choice=CHOICES))
    assert _output(llm, case.prompt, ungated).text in CHOICES  # without markers: at once


def test_a_prompt_that_closed_the_reasoning_is_constrained_at_once(llm, case):
    closed = case.prompt + [7, 8] + list(case.constraint.reasoning_end)  # <think> .. </think>
    out = _output(llm, closed, case.params)
    assert out.finish_reason == "stop" and out.text in CHOICES
    ungated = replace(case.params, structured_outputs=StructuredOutputsParams(choice=CHOICES))
    assert out.token_ids == _output(llm, closed, ungated).token_ids


@pytest.fixture(scope="module")
def others(model_dir):
    """Engines that must give the same tokens: forks aside, speculation both ways and a pool
    so small that the batch below is preempted."""
    return {
        "ngram": _llm(
            model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4}
        ),
        "self_draft": _llm(
            model_dir,
            speculative_config={
                "method": "draft_model",
                "model": "self:3",
                "num_speculative_tokens": 3,
            },
        ),
        "small": _llm(
            model_dir,
            block_size=8,  # 6 blocks of 8 tokens
            kv_cache_memory=6 * NUM_LAYERS * 2 * 8 * 3 * 64 * 4,
        ),
    }


def test_forks_speculation_and_preemption_give_the_same_tokens(llm, case, others):
    closed = case.prompt + list(case.constraint.reasoning_end)
    prompts = [case.prompt, closed] * 4
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, case.params, use_tqdm=False)]
    assert _answer(llm, case, expected[0]) in CHOICES and expected[1] != expected[0]
    forks = [o.token_ids for o in _group(llm, case.prompt, replace(case.params, n=2))]
    assert forks[0] == expected[0]  # completion 0 draws as n = 1 does
    if case.params.greedy:
        assert forks[1] == expected[0]
    for name, other in others.items():
        got = [o.outputs[0].token_ids for o in other.generate(prompts, case.params, use_tqdm=False)]
        assert got == expected, name
    assert others["ngram"].engine.stats().spec_num_accepted_tokens > 0
    assert others["self_draft"].engine.stats().spec_num_accepted_tokens > 0
    assert others["small"].engine.stats().num_preemptions > 0


_ids = iter(range(10**6))


def _run(llm, prompt, params, resume: Resume | None = None) -> Request:
    """The request, run to its end on `llm`'s engine alone."""
    engine = llm.engine
    request = engine.make_request(f"gate-{next(_ids)}", prompt, params, resume=resume)
    engine.submit(request)
    while engine.has_unfinished_requests():
        engine.step()
    return request


def test_a_resumed_request_continues_at_every_seam(llm, case):
    """Migration: the gate is rebuilt from prompt + replayed outputs, before the marker, inside
    it and after it."""
    whole = _run(llm, case.prompt, case.params).output_token_ids
    assert len(whole) > len(case.thinking)
    for k in range(1, len(whole)):
        resume = Resume(tuple(whole[:k]), len(llm.tokenizer.decode(whole[:k])))
        resumed = _run(llm, case.prompt, case.params, resume)  # its outputs: whole[:k] + the rest
        assert resumed.output_token_ids == whole and resumed.status.finish_reason == "stop", k


@pytest.fixture(scope="module")
def decode_llm(model_dir):
    return _llm(model_dir)


def _pd(prefill: LLM, decode: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    """The P/D path in one process: `decode` parks the request for remote KV; `prefill` runs
    it as a prefill worker does (with the params a decode worker sends it: max_tokens 1, the
    grammar and its markers as given) and samples the first token; the prompt's KV is copied
    into the blocks `decode` gave; `decode` continues from that token."""
    rid = f"pd-{next(_ids)}"
    req = decode.engine.make_request(rid, prompt, params)
    dest = decode.engine.add_remote_prefill_request(req)
    assert dest
    sent = _run(prefill, prompt, _for_prefill(req))
    blocks = decode.engine.limits.blocks_for(len(prompt))
    src = sent.block_tables[0][blocks - len(dest) : blocks]  # kept after the request ended
    decode.engine.runner.kv_cache[dest] = prefill.engine.runner.kv_cache[src]
    decode.engine.finish_remote_prefill(rid, SampledToken(sent.output_token_ids[0]))
    while decode.engine.has_unfinished_requests():
        decode.engine.step()
    return req.output_token_ids


def test_the_pd_path_gives_the_same_tokens(llm, decode_llm, case):
    """The prefill worker samples the first token behind the gate its prompt leaves (closed:
    unconstrained; open: the grammar's first token); the decode worker's gate follows from
    the same prompt and that token."""
    for prompt in (case.prompt, case.prompt + list(case.constraint.reasoning_end)):
        expected = _output(llm, prompt, case.params).token_ids
        assert _pd(llm, decode_llm, prompt, case.params) == expected


def test_markers_outside_the_vocabulary_are_refused(llm):
    so = StructuredOutputsParams(regex="a", reasoning_start=(1,), reasoning_end=(10**7,))
    with pytest.raises(ValueError, match="^reasoning_end token ids must be in"):
        llm.engine.make_request("bad-marker", [1, 2], SamplingParams(structured_outputs=so))
