"""The checks on a request's inputs before anything is tokenized or sent (each refusal a 400
naming the field): text size (`max_prompt_chars`, `encode_text`), item counts, the batch
(prompts x n), token ids against the vocabulary, and the context length."""

from __future__ import annotations

from engine.processing.tokenizer import Tokenizer
from router.config import LimitsConfig
from router.endpoints.chat.protocol import ChatCompletionRequest
from router.endpoints.completions.protocol import CompletionRequest
from router.generation.model_card import ModelCard
from router.http.errors import bad_request


def max_prompt_chars(card: ModelCard, limit: int, limits: LimitsConfig) -> int:
    """The longest text tokenized for a context of `limit` tokens: --max-prompt-chars, else
    the longest that can fit (limit x the longest vocabulary entry)."""
    return limits.max_prompt_chars or limit * card.longest_token_chars


def encode_text(
    tok: Tokenizer, text: str, add_special_tokens: bool, max_chars: int, param: str
) -> list[int]:
    """`text`'s token ids; a text over `max_chars` is a 400 naming `param`, never tokenized."""
    if len(text) > max_chars:
        raise bad_request(
            f"{param} has {len(text)} characters, more than the {max_chars} this "
            "server tokenizes (the context's tokens x the longest token, or "
            "--max-prompt-chars)",
            param,
            "context_length_exceeded",
        )
    return tok.encode(text, add_special_tokens=add_special_tokens)


def check_count(items, most: int, param: str, what: str) -> None:
    if items is not None and len(items) > most:
        raise bad_request(
            f"{param} has {len(items)} {what}, more than the {most} this server accepts",
            param,
            "too_many_items",
        )


def check_counts(req: ChatCompletionRequest | CompletionRequest, limits: LimitsConfig) -> None:
    check_count(
        [req.stop] if isinstance(req.stop, str) else req.stop,
        limits.max_stop_strings,
        "stop",
        "strings",
    )
    check_count(req.bad_words, limits.max_bad_words, "bad_words", "words")
    check_count(req.logit_bias, limits.max_logit_bias, "logit_bias", "entries")
    check_batch(1, req.n, limits, "n")


def check_batch(prompts: int, n: int, limits: LimitsConfig, param: str) -> None:
    """At most max_prompts_per_request prompts and max_choices_per_request completions."""
    if prompts > limits.max_prompts_per_request:
        raise bad_request(
            f"{param} has {prompts} prompts, more than the "
            f"{limits.max_prompts_per_request} this server accepts in one "
            "request",
            param,
            "too_many_items",
        )
    if n * prompts > limits.max_choices_per_request:
        raise bad_request(
            f"n x prompts = {n} x {prompts} = {n * prompts} completions, more than "
            f"the {limits.max_choices_per_request} this server generates for one "
            "request",
            "n",
            "too_many_items",
        )


def check_token_ids(ids, card: ModelCard, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < card.vocab_size]
    if bad:
        raise bad_request(
            f"{param} token ids must be in [0, {card.vocab_size}), got {bad[:5]}", param
        )


def check_length(
    ids: list[int], max_tokens: int | None, limit: int, prompt_param: str, max_tokens_param: str
) -> None:
    if not ids:
        raise bad_request(f"{prompt_param} must not be empty", prompt_param)
    if len(ids) >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your "
            f"{prompt_param} has {len(ids)} tokens (at least one must remain for the output).",
            prompt_param,
            "context_length_exceeded",
        )
    if max_tokens is not None and len(ids) + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the {prompt_param}, {max_tokens} "
            f"for the completion). Reduce {max_tokens_param}.",
            max_tokens_param,
            "context_length_exceeded",
        )
