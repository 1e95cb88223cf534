"""A worker compiles constraints in a killable child process (engine/structured/compile_process.py,
the router's too): a pathological schema is refused at the time limit, naming its field, and
the next constraint compiles in a fresh child; the grammar the child sends back (serialized,
rebuilt here) masks exactly as one compiled in this thread; equal constraints compile once,
concurrent askers included; an over-size constraint is refused before any compile; an engine
refuses such a request and takes nothing, then generates what an in-thread compile gives."""

import threading
import time

import pytest
import torch
import xgrammar as xgr

from engine import LLM, SamplingParams
from engine.checks import FieldError
from engine.processing.tokenizer import Tokenizer
from engine.structured.compile_process import CompileLimits
from engine.structured.compiler import GrammarCompiler
from engine.structured.params import StructuredOutputsParams as Params

pytestmark = pytest.mark.timeout(180)

# 60 bytes that xgrammar compiles for ~10 s on a 2-core box (tests/router/test_grammar_limits.py).
PATHOLOGICAL = {"type": "string", "pattern": "(((ab|a){0,20}){0,20}){0,20}"}
LIMIT_S = 1.0
MARGIN_S = 1.5  # the kill, the answer and a loaded machine
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer"}},
    "required": ["x", "y"],
}
CONSTRAINTS = [
    Params(
        json={
            "$defs": {"p": POINT},
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                "at": {"$ref": "#/$defs/p"},
            },
            "required": ["name", "at"],
        },
        disable_any_whitespace=True,
    ),
    Params(json=POINT),  # optional whitespace allowed
    Params(regex=r"[A-Z][a-z]{2,6}-[0-9]{2,3}"),
    Params(choice=("red", "green", "light blue")),
    Params(grammar='root ::= "(" item ("," item)? ")"\nitem ::= [a-c] | "xyz"'),
    Params(json_object=True),
]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


def _compiler(tok: Tokenizer, **limits) -> GrammarCompiler:
    return GrammarCompiler(tok, tok.vocab_size, tok.stop_token_ids, CompileLimits(**limits))


@pytest.fixture(scope="module")
def in_child(tokenizer):
    # No repetition limit: it would refuse PATHOLOGICAL before any compile (the time limit is
    # what these tests are about; test_compile_fairness.py the repetition limit).
    compiler = _compiler(tokenizer, timeout_s=LIMIT_S, max_repetitions=0)
    yield compiler
    compiler.close()


def _counting(compiler: GrammarCompiler, monkeypatch) -> list:
    """The constraints `compiler` sends to its compile processes, from now on."""
    sent, inner = [], compiler._processes.compile

    def compile(params, timeout_s):
        sent.append(params)
        return inner(params, timeout_s)

    monkeypatch.setattr(compiler._processes, "compile", compile)
    return sent


def test_a_pathological_schema_is_refused_at_the_limit_and_the_pool_recovers(in_child, monkeypatch):
    in_child.compile(Params(regex="[0-9]+"))  # the child is up: what follows is compile time
    start = time.monotonic()
    with pytest.raises(FieldError) as refused:
        in_child.compile(Params(json=PATHOLOGICAL))
    took = time.monotonic() - start
    assert refused.value.field == "json"
    assert f"did not compile within {LIMIT_S:g} s" in str(refused.value)
    assert "--grammar-compile-timeout" in str(refused.value)
    assert took < LIMIT_S + MARGIN_S, took  # killed: unbounded, it compiles for ~10 s
    in_child.matcher(Params(regex="[a-z]{2}"))  # a fresh child compiles the next one
    with pytest.raises(FieldError, match="regex is not valid") as invalid:
        in_child.compile(Params(regex="(unclosed"))
    assert invalid.value.field == "regex"
    # The same schema again (as text this time): refused from the cache, not compiled again.
    sent = _counting(in_child, monkeypatch)
    start = time.monotonic()
    with pytest.raises(FieldError, match="did not compile"):
        in_child.compile(
            Params(json='{"type": "string", "pattern": "(((ab|a){0,20}){0,20}){0,20}"}')
        )
    assert sent == [] and time.monotonic() - start < 0.5


def _allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten()


@pytest.mark.parametrize("params", CONSTRAINTS, ids=lambda p: p.kind)
def test_a_grammar_from_the_child_masks_as_one_compiled_in_thread(in_child, tokenizer, params):
    """Both matchers walk the same random path through the grammar (a token the masks allow,
    each step) and give the same mask at every step, until the grammar ends."""
    in_thread = _compiler(tokenizer, timeout_s=0)
    assert in_thread._processes is None
    a, b = in_child.matcher(params), in_thread.matcher(params)
    vocab = tokenizer.vocab_size
    mask_a, mask_b = xgr.allocate_token_bitmask(1, vocab), xgr.allocate_token_bitmask(1, vocab)
    rng = torch.Generator().manual_seed(0)
    for _ in range(60):
        assert a.fill_mask(mask_a, 0) and b.fill_mask(mask_b, 0)
        assert torch.equal(mask_a, mask_b)
        allowed = _allowed(mask_a, vocab)
        token = int(allowed[torch.randint(len(allowed), (1,), generator=rng)])
        assert a.accept(token) and b.accept(token)
        assert a.terminated == b.terminated
        if a.terminated:
            break


def test_equal_constraints_compile_once_even_when_asked_at_once(in_child, monkeypatch):
    sent = _counting(in_child, monkeypatch)
    params = Params(json={"type": "array", "items": {"type": "integer"}, "maxItems": 7})
    got, barrier = [], threading.Barrier(4)

    def ask():
        barrier.wait()
        got.append(in_child.compile(params))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(sent) == 1 and len(got) == 4 and all(g is got[0] for g in got)


def test_an_over_size_constraint_is_refused_before_any_compile(tokenizer):
    compiler = _compiler(tokenizer, timeout_s=LIMIT_S, max_bytes=64)
    with pytest.raises(FieldError, match="more than the 64 this server compiles") as refused:
        compiler.compile(Params(choice=tuple("x" * 10 for _ in range(7))))
    assert refused.value.field == "choice" and "--max-grammar-bytes" in str(refused.value)
    assert compiler._processes._free.get_nowait() is None  # no child was started


def test_an_engine_refuses_a_pathological_request_and_takes_nothing(model_dir):
    """The engine's request building (what a worker calls off its event loop) refuses it at
    the limit; the engine holds nothing for it; then a valid constraint generates exactly what
    an engine compiling in-thread generates."""
    kw = dict(num_layers=1, dtype="float32", kv_cache_memory=16 << 20)
    llm = LLM(str(model_dir), grammar_compile_timeout_s=LIMIT_S, max_grammar_repetitions=0, **kw)
    engine = llm.engine
    engine.make_request("warm", "Hi", SamplingParams(structured_outputs={"regex": "[0-9]"}))
    start = time.monotonic()
    with pytest.raises(FieldError, match="did not compile within") as refused:
        engine.make_request("r", "Hi", SamplingParams(structured_outputs={"json": PATHOLOGICAL}))
    assert time.monotonic() - start < LIMIT_S + MARGIN_S
    assert isinstance(refused.value, ValueError)  # a worker's INVALID_ARGUMENT
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, stats.num_blocks)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=40,
        structured_outputs={"json": CONSTRAINTS[0].json, "disable_any_whitespace": True},
    )
    out = llm.generate(["Describe a person as JSON:"], params, use_tqdm=False)[0].outputs[0]
    reference = LLM(str(model_dir), grammar_compile_timeout_s=0, **kw)
    want = reference.generate(["Describe a person as JSON:"], params, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (want.token_ids, want.finish_reason)
