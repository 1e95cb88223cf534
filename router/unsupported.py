"""Request fields pdserve does not act on: the vLLM ones whose effect it lacks are a 400
naming the field (a client moving from vLLM never gets a silent difference); any other
unknown field is ignored with one warning per field name, as vLLM ignores fields it does
not know."""
from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any, Callable

from router.errors import bad_request
from router.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)


def _set(v: Any) -> bool:
    return v is not None


def _true(v: Any) -> bool:
    return bool(v)


# vLLM request field -> whether its value asks for something pdserve does not do.
_LACKING: dict[str, Callable[[Any], bool]] = {
    "use_beam_search": _true,
    "length_penalty": lambda v: v is not None and v != 1.0,
    "early_stopping": _true,
    "logits_processors": _true,
    "logprob_token_ids": _set,
    "prompt_embeds": _set,
    "spaces_between_special_tokens": lambda v: v is False,
    "truncation_side": lambda v: v not in (None, "left"),
    "return_token_ids": _true,
    "return_prompt_text": _true,
    "kv_transfer_params": _set,
    "ec_transfer_params": _set,
    "vllm_xargs": _set,
    "repetition_detection": _set,
    "thinking_token_budget": lambda v: v is not None and v != -1,
    "reasoning_effort": _set,
    "chat_template": _set,
    "watermarking": _true,
}


def refuse_unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", "best_of")
    else:
        if (req.model_extra or {}).get("echo"):
            raise bad_request("echo is not supported for chat completions", "echo")
    for name, value in (req.model_extra or {}).items():
        lacking = _LACKING.get(name)
        if lacking is None:
            if not (name == "echo" and isinstance(req, ChatCompletionRequest)):
                _warn_ignored(name)
        elif lacking(value):
            raise bad_request(f"{name} is not supported by this server", name)


@lru_cache(maxsize=1024)
def _warn_ignored(name: str) -> None:
    """Logs once per field name (bounded, so random names cannot grow memory)."""
    log.warning("request field %r is not used by this server and is ignored", name)
