"""The reasoning gate (engine/structured/gate.py) and a gated GrammarState, over a five-token
vocabulary: the prompt decides where the gate starts; the end marker opens it (across
partial matches); while closed nothing is masked and the matcher sees nothing; drafts that
cross the marker are checked against the grammar after it and rolled back exactly; a fork
carries the gate."""

import pytest
import torch
import xgrammar as xgr

from engine.structured.compile_process import CompileLimits
from engine.structured.compiler import GrammarCompiler
from engine.structured.gate import ReasoningGate
from engine.structured.params import StructuredOutputsParams

EOS, A, B, START, END = range(5)
VOCAB = [b"", b"a", b"b", b"<", b">"]  # EOS: special, never inside an output
MARKERS = {"reasoning_start": (START,), "reasoning_end": (END, END)}


@pytest.mark.parametrize(
    "prompt, is_open",
    [
        ([A, B], False),  # no marker: the model starts by thinking
        ([A, START], False),
        ([START, A, END, END], True),  # the template closed the thinking
        ([START, END, END, A, B], True),
        ([END, END, START, A], False),  # the last marker is the start
        ([START, END, A, END], False),  # a broken end marker is no marker
    ],
)
def test_the_prompts_last_marker_sets_the_gate(prompt, is_open):
    gate = ReasoningGate.for_prompt((START,), (END, END), prompt)
    assert (gate is None) == is_open
    assert ReasoningGate.for_prompt(None, None, prompt) is None  # no markers: never gated


def test_the_end_marker_opens_the_gate_across_partial_matches():
    gate = ReasoningGate((A, A, B))
    for token in (A, A, A, START, A, A, A):
        gate = gate.after(token)
        assert gate is not None
    assert gate.after(B) is None
    assert ReasoningGate((B,)).after(A).after(B) is None


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(VOCAB, len(VOCAB), frozenset({EOS}), CompileLimits(timeout_s=0))


def _allowed(state, after=()) -> set[int] | None:
    """The tokens the state's mask allows after `after`; None: no mask."""
    bitmask = xgr.allocate_token_bitmask(1, len(VOCAB))
    if not state.fill_mask(bitmask, 0, tuple(after)):
        return None
    logits = torch.zeros(1, len(VOCAB))
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return {i for i in range(len(VOCAB)) if logits[0, i] == 0}


def test_closed_the_matcher_sees_nothing_then_starts_after_the_marker(compiler):
    state = compiler.matcher(StructuredOutputsParams(regex="ab", **MARKERS), [A, START])
    assert _allowed(state) is None and not state.active
    for token in (B, EOS, END, A):  # EOS would be the grammar's stop: nothing terminates
        assert state.accept(token) and not state.terminated
    assert state.accept(END) and not state.active  # END A END: no marker
    assert state.accept(END) and state.active and _allowed(state) == {A}  # END END: one
    assert not state.accept(B)
    assert state.accept(A) and state.accept(B) and state.accept(EOS) and state.terminated


def test_drafts_may_cross_the_marker_and_are_rolled_back(compiler):
    state = compiler.matcher(StructuredOutputsParams(regex="ab", **MARKERS), [START])
    assert state.valid_prefix([B, END, END, A, B, EOS]) == 6
    assert state.valid_prefix([B, END, END, B]) == 3  # after the marker, the grammar decides
    assert state.valid_prefix([A, END]) == 2
    assert _allowed(state, [END]) is None  # the draft ends inside the marker: no mask
    assert _allowed(state, [END, END]) == {A}
    assert _allowed(state, [END, END, A]) == {B}
    assert _allowed(state, [END, END, B]) is None  # leaves the grammar: never kept
    assert _allowed(state, [END, END, A, B, EOS]) is None  # the sequence ends at the stop token
    assert not state.active and _allowed(state) is None  # all of it rolled back
    assert state.accept(B) and state.accept(B)


def test_a_fork_carries_the_gate_and_its_partial_marker(compiler):
    state = compiler.matcher(StructuredOutputsParams(regex="ab", **MARKERS), [START])
    assert state.accept(END)
    fork = state.fork()
    assert fork.accept(END) and fork.active and not fork.accept(B)
    assert not state.active and state.accept(B)  # the parent did not move


def test_a_prompt_that_closed_the_reasoning_is_constrained_at_once(compiler):
    state = compiler.matcher(StructuredOutputsParams(regex="ab", **MARKERS), [START, END, END])
    assert state.active and _allowed(state) == {A} and not state.accept(END)
    plain = compiler.matcher(StructuredOutputsParams(regex="ab"), [START])
    assert plain.active and _allowed(plain) == {A}


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"reasoning_start": (1,)}, "reasoning_end"),
        ({"reasoning_end": (1,)}, "reasoning_start"),
        ({"reasoning_start": (), "reasoning_end": (1,)}, "reasoning_start"),
        ({"reasoning_start": (1,), "reasoning_end": ("x",)}, "reasoning_end"),
        ({"reasoning_start": (1,), "reasoning_end": (-1,)}, "reasoning_end"),
    ],
)
def test_malformed_markers_are_refused(fields, field):
    from engine.checks import FieldError

    with pytest.raises(FieldError) as err:
        StructuredOutputsParams(regex="a", **fields)
    assert err.value.field == field


def test_markers_gate_the_grammar_and_do_not_change_it():
    gated = StructuredOutputsParams(regex="a", reasoning_start=[1], reasoning_end=[2, 3])
    assert (gated.reasoning_start, gated.reasoning_end) == ((1,), (2, 3))  # lists become tuples
    plain = StructuredOutputsParams(regex="a")
    assert gated != plain and gated.key() == plain.key()  # one compile serves both
