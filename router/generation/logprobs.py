"""Logprobs as OpenAI / vLLM render them: completions (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`), chat (`content` entries with real token bytes) and vLLM's
`prompt_logprobs`."""

from __future__ import annotations

import codecs
from functools import lru_cache
from typing import Any

from engine.processing.tokenizer import Tokenizer
from engine.processing.tokens import Logprob

MIN_LOGPROB = -9999.0  # what -inf becomes in JSON (OpenAI, vLLM)


def _clamp(v: float) -> float:
    return max(v, MIN_LOGPROB)


class TokenText:
    """Token id -> its text, its real bytes, its label in logprobs."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(lambda t: tokenizer.decode([t]))
        self.bytes = lru_cache(maxsize=65536)(tokenizer.token_bytes)

    def label(self, token_id: int, as_id: bool) -> str:
        return f"token_id:{token_id}" if as_id else self.text(token_id)

    def chat_entry(self, token_id: int, logprob: float, as_id: bool) -> dict[str, Any]:
        raw = self.label(token_id, True).encode() if as_id else self.bytes(token_id)
        return {
            "token": self.label(token_id, as_id),
            "logprob": _clamp(logprob),
            "bytes": list(raw),
        }


class TextOffsets:
    """Where each token's text starts in a choice's returned text, fed token by token: the
    count of complete characters before it (a token that continues a multi-byte character
    starts where that character does). Incremental: no re-decoding of the text so far."""

    def __init__(self, start: int = 0) -> None:
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_bytes: bytes) -> int:
        offset = self.chars
        self.chars += len(self._decoder.decode(token_bytes))
        return offset


def completion_logprobs(
    tokens: TokenText,
    entries: list[tuple[int, Logprob | None]],
    k: int,
    offsets: TextOffsets,
    skip_special: bool,
    as_id: bool,
) -> dict[str, Any]:
    """`entries`: (token id, its logprob or None for a prompt's first token). Top entries, as
    vLLM: the sampled token first (also when it is not among the k most likely), then the k."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    tok = tokens.tokenizer
    for token_id, lp in entries:
        out["tokens"].append(tokens.label(token_id, as_id))
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(_clamp(lp.logprob))
            top = {tokens.label(token_id, as_id): _clamp(lp.logprob)}
            for t, v in lp.top[:k]:
                top.setdefault(tokens.label(t, as_id), _clamp(v))
            out["top_logprobs"].append(top)
        hidden = skip_special and tok.is_special(token_id)
        out["text_offset"].append(offsets.feed(b"" if hidden else tokens.bytes(token_id)))
    return out


def chat_logprobs(tokens: TokenText, lps: list[Logprob], k: int, as_id: bool) -> dict[str, Any]:
    return {
        "content": [
            {
                **tokens.chat_entry(lp.token_id, lp.logprob, as_id),
                "top_logprobs": [tokens.chat_entry(t, v, as_id) for t, v in lp.top[:k]],
            }
            for lp in lps
        ]
    }


def prompt_logprobs(
    tokens: TokenText, lps: list[Logprob] | None, k: int
) -> list[dict[str, Any] | None] | None:
    """vLLM's shape: null for the first prompt token, then {"<id>": {logprob, rank,
    decoded_token}} holding the prompt token and the k most likely."""
    if lps is None:
        return None

    def entry(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": _clamp(logprob), "rank": rank, "decoded_token": tokens.text(token_id)}

    out: list[dict[str, Any] | None] = [None]
    for lp in lps:
        d = {str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank or None)}
        for j, (t, v) in enumerate(lp.top[:k]):
            d.setdefault(str(t), entry(t, v, j + 1))
        out.append(d)
    return out
