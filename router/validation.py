"""From an HTTP body to a `Prepared` request: parse, check ranges, apply the chat template,
tokenize, check the context length. Every refusal is a 400 `APIError` naming the field."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import ValidationError

from engine.sampling_params import SamplingParams
from engine.tokenizer import ChatTemplateError, Tokenizer
from router.errors import APIError, bad_request, from_validation_errors
from router.protocol import ChatCompletionRequest, CompletionRequest, TextPart

Kind = Literal["chat", "completion"]
MAX_SEED = (1 << 63) - 1


@dataclass(frozen=True)
class ModelCard:
    """What the router serves: one model, one tokenizer, one context length."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    aliases: frozenset[str] = frozenset()
    max_n: int = 128


@dataclass(frozen=True)
class Prepared:
    kind: Kind
    model: str
    prompts: list[list[int]]  # token ids; one entry per prompt (completions accept a batch)
    sampling: SamplingParams
    cache_salt: str | None
    stream: bool
    include_usage: bool
    chat_logprobs: bool = False  # chat: logprobs as `content` entries


def parse_body(kind: Kind, body: bytes) -> ChatCompletionRequest | CompletionRequest:
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        return model.model_validate_json(body or b"", strict=True)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


def prepare(kind: Kind, body: bytes, card: ModelCard) -> Prepared:
    req = parse_body(kind, body)
    if req.model is not None and req.model != card.name and req.model not in card.aliases:
        raise APIError(404, f"The model `{req.model}` does not exist.", "model", "model_not_found")
    _refuse_unsupported(req)
    if isinstance(req, ChatCompletionRequest):
        prompts, prompt_param = [_chat_prompt(req, card.tokenizer)], "messages"
        max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs and req.top_logprobs > 0:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        logprobs_param = "top_logprobs"
    else:
        prompts, prompt_param = _completion_prompts(req, card), "prompt"
        max_tokens, max_tokens_param = req.max_tokens, "max_tokens"
        logprobs, logprobs_param = req.logprobs, "logprobs"
    sampling = _sampling(req, max_tokens, logprobs, card,
                         {"max_tokens": max_tokens_param, "logprobs": logprobs_param})
    for ids in prompts:
        _check_length(ids, sampling.max_tokens, card, prompt_param, max_tokens_param)
    if req.cache_salt is not None and not req.cache_salt:
        raise bad_request("cache_salt must be a non-empty string when given", "cache_salt")
    return Prepared(
        kind=kind, model=card.name, prompts=prompts, sampling=sampling,
        cache_salt=req.cache_salt, stream=req.stream,
        include_usage=bool(req.stream and req.stream_options and req.stream_options.include_usage),
        chat_logprobs=kind == "chat" and logprobs is not None,
    )


def _refuse_unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise bad_request("echo is not supported", "echo")
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", "best_of")
    else:
        if req.tools:
            raise bad_request("tools are not supported", "tools")
        if req.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice is not supported", "tool_choice")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise bad_request("only response_format type 'text' is supported", "response_format")


def _chat_prompt(req: ChatCompletionRequest, tok: Tokenizer) -> list[int]:
    messages = []
    for i, m in enumerate(req.messages):
        if m.content is None or isinstance(m.content, str):
            text = m.content or ""
        else:
            parts = []
            for j, part in enumerate(m.content):
                if not isinstance(part, TextPart):
                    where = f"messages.{i}.content.{j}.type"
                    raise bad_request(f"{where}: content part type {part.type!r} is not "
                                      "supported (only text)", where)
                parts.append(part.text)
            text = "".join(parts)
        messages.append({"role": m.role, "content": text})
    try:
        return tok.encode(tok.render_chat(messages, req.add_generation_prompt))
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None


def _completion_prompts(req: CompletionRequest, card: ModelCard) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        raw: list = [p]
    elif p and isinstance(p[0], int):
        raw = [p]
    else:
        raw = list(p)
    if not raw:
        raise bad_request("prompt must not be empty", "prompt")
    out = []
    for item in raw:
        ids = card.tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else list(item)
        bad = [t for t in ids if not 0 <= t < card.vocab_size]
        if bad:
            raise bad_request(f"prompt token ids must be in [0, {card.vocab_size}), got {bad[:5]}",
                              "prompt")
        out.append(ids)
    return out


def _sampling(req, max_tokens, logprobs, card: ModelCard, names: dict[str, str]) -> SamplingParams:
    if not 1 <= req.n <= card.max_n:
        raise bad_request(f"n must be in [1, {card.max_n}], got {req.n}", "n")
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise bad_request(f"seed must be in [0, 2**63 - 1], got {req.seed}", "seed")
    if req.top_k is not None and req.top_k < -1:
        raise bad_request(f"top_k must be >= 0 (or -1 to disable), got {req.top_k}", "top_k")
    bad_ids = [t for t in req.stop_token_ids or () if not 0 <= t < card.vocab_size]
    if bad_ids:
        raise bad_request(f"stop_token_ids must be in [0, {card.vocab_size}), got {bad_ids[:5]}",
                          "stop_token_ids")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k or 0,
            top_p=1.0 if req.top_p is None else req.top_p,
            min_p=req.min_p or 0.0,
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
        )
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        param = names.get(field, field)
        raise bad_request(str(exc).replace(field, param, 1), param) from None


def _check_length(ids: list[int], max_tokens: int | None, card: ModelCard,
                  prompt_param: str, max_tokens_param: str) -> None:
    limit = card.max_model_len
    if not ids:
        raise bad_request(f"{prompt_param} must not be empty", prompt_param)
    if len(ids) >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your "
            f"{prompt_param} has {len(ids)} tokens (at least one must remain for the output).",
            prompt_param, "context_length_exceeded")
    if max_tokens is not None and len(ids) + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the {prompt_param}, {max_tokens} "
            f"for the completion). Reduce {max_tokens_param}.",
            max_tokens_param, "context_length_exceeded")
