"""The reasoning parsers (router/parsers/reasoning/think.py): each fixture splits into the expected
reasoning and content, the same in any pieces (char by char, random cuts, 3-char "tokens");
text without a marker goes out at once and only a marker prefix is held; `in_answer`
follows the split; the prompt's tail sets the starting phase; unknown names list the known."""

import random

import pytest

from router.parsers.reasoning.parser import reasoning_parser, reasoning_parser_names

# (parser, flags, text, reasoning, content, in_answer at the end)
CASES = [
    (
        "deepseek_r1",
        {},
        "<think>\nLet me see.</think>\n\nIt is 4.",
        "\nLet me see.",
        "\n\nIt is 4.",
        True,
    ),
    ("deepseek_r1", {}, "Let me see.</think>It is 4.", "Let me see.", "It is 4.", True),
    (
        "deepseek_r1",
        {},
        "Still thinking <think> about it",
        "Still thinking <think> about it",
        "",
        False,
    ),
    ("deepseek_r1", {}, "<think>a</think>b</think><think>c", "a", "b</think><think>c", True),
    ("deepseek_r1", {}, "<thin", "<thin", "", False),
    (
        "deepseek_r1",
        {"prompt_ends_reasoning": True},
        "<think>a</think>b",
        "",
        "<think>a</think>b",
        True,
    ),
    ("qwen3", {}, "<think>\nHmm.\n</think>\n\nParis.", "\nHmm.\n", "\n\nParis.", True),
    ("qwen3", {}, "Just the answer, 2 < 3.", "", "Just the answer, 2 < 3.", False),
    ("qwen3", {}, "<think>cut off", "cut off", "", False),
    ("qwen3", {}, "Hi <think>x</think> there", "x", "Hi  there", True),
    ("qwen3", {"prompt_starts_reasoning": True}, "Hmm.</think>Paris.", "Hmm.", "Paris.", True),
    (
        "qwen3",
        {"prompt_starts_reasoning": True},
        "<think>Hmm.</think>Paris.",
        "Hmm.",
        "Paris.",
        True,
    ),
    ("qwen3", {}, "Hmm.</think>Paris.", "", "Hmm.Paris.", True),
    ("qwen3", {"prompt_ends_reasoning": True}, "<think>a</think>b", "", "<think>a</think>b", True),
]


def _split(name, flags, pieces):
    parser = reasoning_parser(name)(**flags)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    assert not any(d.tool_calls for d in deltas)
    return (
        "".join(d.reasoning for d in deltas),
        "".join(d.content for d in deltas),
        parser.in_answer,
    )


def _splits(text):
    out = {
        "whole": [text],
        "chars": list(text),
        "tokens": [text[i : i + 3] for i in range(0, len(text), 3)],
    }
    for seed in range(3):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), len(text) // 4))
        out[f"random{seed}"] = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return out


@pytest.mark.parametrize("name,flags,text,reasoning,content,in_answer", CASES)
def test_split_in_any_pieces(name, flags, text, reasoning, content, in_answer):
    for split, pieces in _splits(text).items():
        assert _split(name, flags, pieces) == (reasoning, content, in_answer), split


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_only_a_marker_prefix_is_held(name):
    parser = reasoning_parser(name)()
    field = "reasoning" if name == "deepseek_r1" else "content"
    for c in "Plain text, 2 > 1.":
        assert getattr(parser.feed(c), field) == c
    assert getattr(parser.feed("ok </thi"), field) == "ok "
    assert not parser.in_answer
    delta = parser.feed("nk>Yes <")
    assert (delta.reasoning, delta.content) == ("", "Yes <")  # nothing held in the answer
    assert parser.in_answer and parser.feed("b").content == "b"


def test_the_prompt_tail_sets_the_first_phase():
    cls = reasoning_parser("qwen3")
    off = cls.for_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.prompt_ends_reasoning and off.in_answer
    assert off.feed("<think>x").content == "<think>x"
    on = cls.for_prompt("<|im_start|>assistant\n<think>\n")
    assert on.prompt_starts_reasoning and on.feed("x</think>y").reasoning == "x"
    plain = cls.for_prompt("<|im_start|>assistant\n")
    assert not (plain.prompt_starts_reasoning or plain.prompt_ends_reasoning)
    assert plain.feed("x").content == "x"


def test_unknown_parser_name_lists_the_known_ones():
    assert {"deepseek_r1", "qwen3"} <= set(reasoning_parser_names())
    with pytest.raises(ValueError, match="deepseek_r1.*qwen3"):
        reasoning_parser("nope")
