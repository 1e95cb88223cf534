"""Recorded vLLM behaviour: (request, expected response semantics) for what a user moving from
vLLM's OpenAI server sends, derived from vLLM's documented behaviour (its OpenAI-compatible
server docs and `vllm/entrypoints/openai/protocol.py`: field defaults, validators, response
models). test_vllm_differential.py replays every case against a real pdserve cluster
through the official `openai` client.

A case's body may name tokens through `Vocab` (ids from the served tokenizer); `expect` maps a
dotted path into the JSON response to a value or a predicate. Every request is greedy and small,
so the table runs in seconds on the 2-layer test cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "The capital of France is"
USER = [{"role": "user", "content": "Say something."}]


@dataclass(frozen=True)
class Vocab:
    """Token ids the cases need, looked up in the served tokenizer."""

    eos: int  # <|im_end|>
    paris: int  # " Paris" (one token)
    paris_bare: int  # "Paris" (one token)
    vocab_size: int


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Callable[[Vocab], dict[str, Any]]
    status: int = 200
    param: str | None = None  # for 4xx: the field the error names
    expect: dict[str, Any] = field(default_factory=dict)  # dotted path -> value | predicate
    why: str = ""  # the vLLM behaviour this pins


def _c(**body):  # a greedy completions body
    return lambda v: {
        "prompt": PROMPT,
        "temperature": 0,
        **{k: (f(v) if callable(f) else f) for k, f in body.items()},
    }


def _chat(**body):
    return lambda v: {
        "messages": USER,
        "temperature": 0,
        **{k: (f(v) if callable(f) else f) for k, f in body.items()},
    }


def is_none(x):
    return x is None


def not_empty(x):
    return bool(x)


CASES: list[Case] = [
    # ---- defaults ---------------------------------------------------------------------------
    Case(
        "completions max_tokens defaults to 16",
        COMPLETIONS,
        _c(ignore_eos=True),
        expect={
            "usage.completion_tokens": 16,
            "choices.0.finish_reason": "length",
            "choices.0.stop_reason": is_none,
        },
        why="CompletionRequest.max_tokens = 16 (as OpenAI)",
    ),
    # ---- min_tokens ---------------------------------------------------------------------------
    Case(
        "min_tokens masks EOS until reached",
        COMPLETIONS,
        _c(min_tokens=4, max_tokens=8, logit_bias=lambda v: {str(v.eos): 100}),
        expect={
            "usage.completion_tokens": 5,
            "choices.0.finish_reason": "stop",
            "choices.0.stop_reason": is_none,
            "choices.0.text": lambda t: "<|im_end|>" not in t,
        },
        why="MinTokensLogitsProcessor: EOS and stop_token_ids get -inf until min_tokens",
    ),
    Case(
        "min_tokens masks stop_token_ids too",
        COMPLETIONS,
        _c(
            min_tokens=3,
            max_tokens=6,
            stop_token_ids=lambda v: [v.paris],
            logit_bias=lambda v: {str(v.paris): 100},
            ignore_eos=True,
        ),
        expect={
            "usage.completion_tokens": 4,
            "choices.0.stop_reason": lambda v: isinstance(v, int),
        },
        why="min_tokens applies to all stop token ids",
    ),
    Case(
        "min_tokens greater than max_tokens is refused",
        COMPLETIONS,
        _c(min_tokens=9, max_tokens=4),
        status=400,
        param="min_tokens",
        why="SamplingParams: min_tokens must be <= max_tokens",
    ),
    # ---- stop tokens and strings ----------------------------------------------------------
    Case(
        "a stop token's text is not in the output",
        COMPLETIONS,
        _c(
            max_tokens=4,
            stop_token_ids=lambda v: [v.paris],
            logit_bias=lambda v: {str(v.paris): 100},
        ),
        expect={
            "choices.0.text": "",
            "choices.0.finish_reason": "stop",
            "usage.completion_tokens": 1,
            "choices.0.stop_reason": lambda r: isinstance(r, int),
        },
        why="detokenizer skips the stop-terminating token unless include_stop_str_in_output",
    ),
    Case(
        "include_stop_str_in_output keeps a stop token's text",
        COMPLETIONS,
        _c(
            max_tokens=4,
            stop_token_ids=lambda v: [v.paris],
            include_stop_str_in_output=True,
            logit_bias=lambda v: {str(v.paris): 100},
        ),
        expect={"choices.0.text": " Paris", "choices.0.finish_reason": "stop"},
        why="include_stop_str_in_output",
    ),
    Case(
        "EOS text is not in the output with skip_special_tokens=false",
        COMPLETIONS,
        _c(max_tokens=4, skip_special_tokens=False, logit_bias=lambda v: {str(v.eos): 100}),
        expect={
            "choices.0.text": "",
            "choices.0.finish_reason": "stop",
            "choices.0.stop_reason": is_none,
        },
        why="EOS is stop-terminating: its text is skipped",
    ),
    Case(
        "a stop string completed by the last allowed token is a stop",
        COMPLETIONS,
        _c(max_tokens=1, stop=[" Paris"], allowed_token_ids=lambda v: [v.paris]),
        expect={
            "choices.0.text": "",
            "choices.0.finish_reason": "stop",
            "choices.0.stop_reason": " Paris",
        },
        why="the detokenizer's stop-string hit overrides the length finish",
    ),
    Case(
        "include_stop_str_in_output keeps the stop string",
        COMPLETIONS,
        _c(
            max_tokens=3,
            stop=["Paris"],
            include_stop_str_in_output=True,
            allowed_token_ids=lambda v: [v.paris],
        ),
        expect={"choices.0.text": " Paris", "choices.0.stop_reason": "Paris"},
        why="include_stop_str_in_output",
    ),
    # ---- token masks and biases -----------------------------------------------------------
    Case(
        "allowed_token_ids restricts every token",
        COMPLETIONS,
        _c(max_tokens=3, ignore_eos=True, allowed_token_ids=lambda v: [v.paris]),
        expect={"choices.0.text": " Paris Paris Paris"},
        why="AllowedTokenIdsLogitsProcessor",
    ),
    Case(
        "logit_bias +100 picks the token",
        COMPLETIONS,
        _c(max_tokens=2, ignore_eos=True, logit_bias=lambda v: {str(v.paris): 100}),
        expect={"choices.0.text": " Paris Paris"},
        why="logit_bias is added to the logits",
    ),
    Case(
        "logit_bias outside the vocabulary is refused",
        COMPLETIONS,
        _c(max_tokens=2, logit_bias=lambda v: {str(v.vocab_size + 5): 1}),
        status=400,
        param="logit_bias",
        why="out-of-vocab token ids in logit_bias are a 400",
    ),
    Case(
        "bad_words are never generated",
        COMPLETIONS,
        _c(
            max_tokens=1,
            bad_words=["Paris"],
            logit_bias=lambda v: {str(v.paris): 100, str(v.paris_bare): 100},
        ),
        expect={"choices.0.text": lambda t: "Paris" not in t},
        why="bad_words: the word with and without a leading space",
    ),
    # ---- prompts ----------------------------------------------------------------------------
    Case(
        "echo prepends the prompt",
        COMPLETIONS,
        _c(max_tokens=2, echo=True),
        expect={"choices.0.text": lambda t: t.startswith(PROMPT) and len(t) > len(PROMPT)},
        why="echo",
    ),
    Case(
        "prompt_logprobs: null first, one entry per prompt token",
        COMPLETIONS,
        _c(max_tokens=1, prompt_logprobs=1),
        expect={
            "choices.0.prompt_logprobs": lambda p: (
                p[0] is None and len(p) == 5 and all(len(d) >= 1 for d in p[1:])
            )
        },
        why="CompletionResponseChoice.prompt_logprobs",
    ),
    Case(
        "truncate_prompt_tokens keeps the last k tokens",
        COMPLETIONS,
        _c(max_tokens=1, truncate_prompt_tokens=3),
        expect={"usage.prompt_tokens": 3},
        why="truncate_prompt_tokens",
    ),
    Case(
        "priority is accepted",
        COMPLETIONS,
        _c(max_tokens=1, priority=-5),
        expect={"choices.0.text": not_empty},
        why="priority (pdserve always honours it)",
    ),
    Case(
        "a completion that no worker can hold is refused",
        COMPLETIONS,
        _c(max_tokens=2000),
        status=400,
        param="max_tokens",
        why="max_model_len: prompt + max_tokens beyond the context is a 400, not a clamp",
    ),
    Case(
        "logprobs above 20 are refused",
        COMPLETIONS,
        _c(max_tokens=1, logprobs=21),
        status=400,
        param="logprobs",
        why="max_logprobs = 20",
    ),
    Case(
        "best_of other than n is refused",
        COMPLETIONS,
        _c(max_tokens=1, best_of=3),
        status=400,
        param="best_of",
        why="not implemented: never ignored",
    ),
    Case(
        "suffix is refused",
        COMPLETIONS,
        _c(max_tokens=1, suffix="!"),
        status=400,
        param="suffix",
        why="vLLM refuses suffix",
    ),
    # ---- chat -------------------------------------------------------------------------------
    Case(
        "chat stop_reason is reported",
        CHAT,
        _chat(max_tokens=1, stop=[" Paris"], allowed_token_ids=lambda v: [v.paris]),
        expect={
            "choices.0.finish_reason": "stop",
            "choices.0.stop_reason": " Paris",
            "choices.0.message.content": "",
        },
        why="ChatCompletionResponseChoice.stop_reason",
    ),
    Case(
        "chat prompt_logprobs at the top level",
        CHAT,
        _chat(max_tokens=1, prompt_logprobs=0),
        expect={"prompt_logprobs": lambda p: p[0] is None and len(p) > 3},
        why="ChatCompletionResponse.prompt_logprobs",
    ),
    Case(
        "continue_final_message with add_generation_prompt is refused",
        CHAT,
        _chat(max_tokens=1, continue_final_message=True, add_generation_prompt=True),
        status=400,
        param="continue_final_message",
        why="vLLM: cannot set both",
    ),
    # ---- structured outputs (one constraint; xgrammar; invalid ones are a 400) ------------
    Case(
        "guided_choice picks one of the choices",
        CHAT,
        _chat(max_tokens=8, guided_choice=["yes", "no"]),
        expect={
            "choices.0.message.content": lambda t: t in ("yes", "no"),
            "choices.0.finish_reason": "stop",
        },
        why="guided_choice (older name of structured_outputs.choice)",
    ),
    Case(
        "structured_outputs regex is followed",
        COMPLETIONS,
        _c(max_tokens=8, structured_outputs={"regex": "[0-9]{3}"}),
        expect={"choices.0.text": lambda t: len(t) == 3 and t.isdigit()},
        why="StructuredOutputsParams.regex",
    ),
    Case(
        "guided_regex is followed",
        COMPLETIONS,
        _c(max_tokens=8, guided_regex="(cat|dog)s?"),
        expect={"choices.0.text": lambda t: t in ("cat", "cats", "dog", "dogs")},
        why="guided_regex",
    ),
    Case(
        "response_format json_schema with an enum",
        CHAT,
        _chat(
            max_tokens=16,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "c", "schema": {"enum": ["red", "green"]}},
            },
        ),
        expect={"choices.0.message.content": lambda t: t in ('"red"', '"green"')},
        why="response_format json_schema -> structured_outputs.json",
    ),
    Case(
        "an invalid regex is refused",
        COMPLETIONS,
        _c(max_tokens=1, guided_regex="(a"),
        status=400,
        param="guided_regex",
        why="the grammar backend fails to compile it",
    ),
    Case(
        "two constraints are refused",
        CHAT,
        _chat(max_tokens=1, guided_regex="a", structured_outputs={"choice": ["a"]}),
        status=400,
        param="guided_regex",
        why="only one kind of structured outputs constraint",
    ),
    Case(
        "guided_whitespace_pattern is refused",
        CHAT,
        _chat(max_tokens=1, guided_json={"type": "object"}, guided_whitespace_pattern=" *"),
        status=400,
        param="guided_whitespace_pattern",
        why="xgrammar (pdserve's only backend) has no whitespace pattern",
    ),
    Case(
        "auto tool choice needs the server's flags",
        CHAT,
        _chat(max_tokens=1, tools=[{"type": "function", "function": {"name": "f"}}]),
        status=400,
        param="tool_choice",
        why="tools default to tool_choice auto, which needs --enable-auto-tool-choice",
    ),
    Case(
        "use_beam_search is refused",
        COMPLETIONS,
        _c(max_tokens=1, use_beam_search=True),
        status=400,
        param="use_beam_search",
    ),
]


def lookup(doc: Any, path: str) -> Any:
    for part in path.split("."):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc
