"""From an HTTP body to a `Prepared` request: parse, check ranges, apply the chat template
(router/generation/chat_render.py), tokenize, apply defaults (OpenAI's, then the model's generation
config), check the context length. Every refusal is a 400 `APIError` naming the field."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Mapping

from engine.checks import FieldError
from engine.lora.request import LoRARequest, lora_id_for
from engine.processing.tokenizer import Tokenizer
from engine.sampling.sampling_params import SamplingParams
from router.config import LimitsConfig
from router.endpoints.base import parse_json
from router.endpoints.chat.protocol import ChatCompletionRequest
from router.endpoints.completions.protocol import CompletionRequest
from router.generation.chat_render import chat_text
from router.generation.chat_tools import ChatTools, combine, read_tools
from router.generation.inputs import (
    check_batch,
    check_counts,
    check_length,
    check_token_ids,
    encode_text,
    max_prompt_chars,
)
from router.generation.model_card import ModelCard
from router.generation.structured import Constraint, constraint
from router.generation.unsupported import refuse_unsupported
from router.http.errors import APIError, bad_request
from router.parsers.message import OutputSetup

Kind = Literal["chat", "completion"]
MAX_SEED = (1 << 63) - 1
COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
_INT32 = (-(1 << 31), (1 << 31) - 1)


@dataclass(frozen=True)
class Prepared:
    kind: Kind
    model: str
    prompts: list[list[int]]  # token ids; one entry per prompt (completions accept a batch)
    sampling: SamplingParams
    cache_salt: str | None
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # every chunk carries the usage so far
    chat_logprobs: bool = False  # chat: logprobs as `content` entries
    priority: int = 0
    echo: list[str] | None = None  # completions with echo: each prompt's text
    tokens_as_ids: bool = False  # logprob tokens as "token_id:<id>"
    request_id: str | None = None  # the client's (body) request id
    constraint: Constraint | None = None  # structured outputs: compile-check before dispatch
    lora: LoRARequest | None = None  # the LoRA adapter `model` named (None: the base model)
    output: OutputSetup | None = None  # chat: reasoning / tool calls to read (None: plain text)


def parse_body(kind: Kind, body: bytes) -> ChatCompletionRequest | CompletionRequest:
    if kind == "chat":
        return parse_json(ChatCompletionRequest, body)
    return parse_json(CompletionRequest, body)


def check_model(
    name: str | None, card: ModelCard, adapters: Mapping[str, str] | None = None
) -> LoRARequest | None:
    """The LoRA adapter `name` selects (None: the base model). `adapters`: the LoRA adapters
    served now, name -> path (router/endpoints/loras/serving.py). An unknown name is vLLM's 404."""
    if name is None or name == card.name or name in card.aliases:
        return None
    path = (adapters or {}).get(name)
    if path is None:
        raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
    return LoRARequest(name, lora_id_for(name), path)


def prepare(
    kind: Kind,
    body: bytes,
    card: ModelCard,
    limit: int | None = None,
    adapters: Mapping[str, str] | None = None,
    limits: LimitsConfig | None = None,
) -> Prepared:
    """`limit`: the longest prompt + output a live worker holds (default: the model card's).
    `adapters`: the LoRA adapters served now (name -> path); `model` may name one. `limits`:
    the caps on a request's inputs (default: LimitsConfig's), checked before tokenizing."""
    return prepare_request(kind, parse_body(kind, body), card, limit, adapters, limits)


def prepare_chat(
    req: ChatCompletionRequest,
    card: ModelCard,
    limit: int | None = None,
    adapters: Mapping[str, str] | None = None,
    limits: LimitsConfig | None = None,
) -> Prepared:
    """`prepare` for a chat request parsed already (the Responses API builds one)."""
    return prepare_request("chat", req, card, limit, adapters, limits)


def prepare_request(
    kind: Kind,
    req: ChatCompletionRequest | CompletionRequest,
    card: ModelCard,
    limit: int | None = None,
    adapters: Mapping[str, str] | None = None,
    limits: LimitsConfig | None = None,
) -> Prepared:
    limit = limit or card.max_model_len
    limits = limits or LimitsConfig()
    lora = check_model(req.model, card, adapters)
    refuse_unsupported(req)
    check_counts(req, limits)
    max_chars = max_prompt_chars(card, limit, limits)
    echo = None  # completions with echo: each prompt's text
    tools, text = ChatTools(None, None, {}), ""
    if isinstance(req, ChatCompletionRequest):
        tools = read_tools(req, card.chat, card.tokenizer)
        text = chat_text(req, card.tokenizer, tools.template_kwargs)
        prompts, prompt_param = (
            [encode_text(card.tokenizer, text, req.add_special_tokens, max_chars, "messages")],
            "messages",
        )
        max_tokens_param = (
            "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        )
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        if req.top_logprobs is not None and not req.logprobs and req.top_logprobs > 0:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        logprobs_param = "top_logprobs"
    else:
        raw = _raw_prompts(req)
        check_batch(len(raw), req.n, limits, "prompt")
        prompts, prompt_param = _completion_prompts(req, raw, card, max_chars), "prompt"
        max_tokens, max_tokens_param = req.max_tokens, "max_tokens"
        if max_tokens is None:
            max_tokens = COMPLETION_MAX_TOKENS
        logprobs, logprobs_param = req.logprobs, "logprobs"
    truncate = None
    if req.truncate_prompt_tokens is not None:
        truncate = _truncation(req.truncate_prompt_tokens, limit - (max_tokens or 0))
        prompts = [ids[-truncate:] for ids in prompts]
    if isinstance(req, CompletionRequest) and req.echo:
        echo = _echo_texts(req, prompts, truncate is not None, card.tokenizer)
    prompt_logprobs = req.prompt_logprobs
    if req.stream and prompt_logprobs:
        raise bad_request(
            "prompt_logprobs are not available when stream is true", "prompt_logprobs"
        )
    if prompt_logprobs is None and echo is not None:
        prompt_logprobs = logprobs  # vLLM: echo with logprobs returns the prompt's too
    if max_tokens is None and "max_tokens" in card.sampling_defaults:
        # The model's max_new_tokens stands in for an omitted chat max_tokens, within the
        # context (vLLM: min(context remainder, request or default max_tokens)).
        max_tokens = max(1, min(card.sampling_defaults["max_tokens"], limit - len(prompts[0])))
    structured = combine(tools, constraint(req, limits.max_grammar_bytes))
    if structured is not None and tools.setup is not None and card.chat.reasoning_markers:
        start, end = card.chat.reasoning_markers  # the constraint binds the answer only
        structured = Constraint(
            replace(structured.params, reasoning_start=start, reasoning_end=end), structured.param
        )
    sampling = _sampling(
        req,
        max_tokens,
        logprobs,
        prompt_logprobs,
        truncate,
        card,
        {"max_tokens": max_tokens_param, "logprobs": logprobs_param},
        structured,
    )
    if tools.keep_special_tokens:
        sampling = replace(sampling, skip_special_tokens=False)
    for ids in prompts:
        check_length(ids, sampling.max_tokens, limit, prompt_param, max_tokens_param)
        if sampling.max_tokens is None and sampling.min_tokens > limit - len(ids):
            raise bad_request(
                f"min_tokens must be <= the {limit - len(ids)} tokens the context "
                f"leaves, got {sampling.min_tokens}",
                "min_tokens",
            )
    if req.cache_salt is not None and not req.cache_salt:
        raise bad_request("cache_salt must be a non-empty string when given", "cache_salt")
    if not _INT32[0] <= req.priority <= _INT32[1]:
        raise bad_request(f"priority must be a 32-bit integer, got {req.priority}", "priority")
    opts = req.stream_options
    include_usage = bool(req.stream and opts and opts.include_usage)
    return Prepared(
        kind=kind,
        model=lora.lora_name if lora else card.name,
        prompts=prompts,
        sampling=sampling,
        cache_salt=req.cache_salt,
        stream=req.stream,
        include_usage=include_usage,
        continuous_usage=bool(include_usage and opts and opts.continuous_usage_stats),
        chat_logprobs=kind == "chat" and logprobs is not None,
        priority=req.priority,
        echo=echo,
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
        request_id=req.request_id,
        constraint=structured,
        lora=lora,
        output=_with_prompt(tools.setup, text) if kind == "chat" else None,
    )


def _with_prompt(setup: OutputSetup | None, prompt_text: str) -> OutputSetup | None:
    """`setup`, knowing whether the rendered prompt closed the reasoning already (Qwen3's
    template with thinking off writes an empty think block) or opened it (DeepSeek-R1's)."""
    if setup is None or setup.reasoning is None:
        return setup
    r, tail = setup.reasoning, prompt_text.rstrip()
    return replace(
        setup,
        prompt_ends_reasoning=tail.endswith(r.end),
        prompt_starts_reasoning=tail.endswith(r.start),
    )


def _truncation(k: int, max_input: int) -> int:
    """vLLM's rules: -1 keeps as many as the context leaves beside max_tokens; more than
    that is refused."""
    kept = max_input if k == -1 else k
    if not 1 <= kept <= max_input:
        raise bad_request(
            f"truncate_prompt_tokens must be in [1, max_model_len - max_tokens = "
            f"{max_input}] (or -1), got {k}",
            "truncate_prompt_tokens",
        )
    return kept


def _echo_texts(
    req: CompletionRequest, prompts: list[list[int]], truncated: bool, tok: Tokenizer
) -> list[str]:
    """What echo puts first: a text prompt as sent; token ids (or a truncated prompt) decoded."""
    raw = (
        req.prompt
        if isinstance(req.prompt, list) and isinstance(req.prompt[0], (str, list))
        else [req.prompt]
    )
    return [
        p if isinstance(p, str) and not truncated else tok.decode(ids)
        for p, ids in zip(raw, prompts)
    ]


def _raw_prompts(req: CompletionRequest) -> list:
    """The prompts of a completion request, as sent (texts or token-id lists)."""
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        return [p]
    return list(p)


def _completion_prompts(
    req: CompletionRequest, raw: list, card: ModelCard, max_chars: int
) -> list[list[int]]:
    if not raw:
        raise bad_request("prompt must not be empty", "prompt")
    out = []
    for item in raw:
        ids = (
            encode_text(card.tokenizer, item, req.add_special_tokens, max_chars, "prompt")
            if isinstance(item, str)
            else list(item)
        )
        check_token_ids(ids, card, "prompt")
        out.append(ids)
    return out


def _logit_bias(bias: dict[str, float] | None, card: ModelCard) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
            ) from None
        out[token] = value
    check_token_ids(out, card, "logit_bias")
    return out


def _default(value, name: str, card: ModelCard, builtin):
    """The request's value, else the model's generation-config default, else the built-in."""
    if value is not None:
        return value
    return card.sampling_defaults.get(name, builtin)


def _sampling(
    req,
    max_tokens,
    logprobs,
    prompt_logprobs,
    truncate,
    card: ModelCard,
    names: dict[str, str],
    structured: Constraint | None,
) -> SamplingParams:
    if not 1 <= req.n <= card.max_n:
        raise bad_request(f"n must be in [1, {card.max_n}], got {req.n}", "n")
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise bad_request(f"seed must be in [0, 2**63 - 1], got {req.seed}", "seed")
    if req.top_k is not None and req.top_k < -1:
        raise bad_request(f"top_k must be >= 0 (or -1 to disable), got {req.top_k}", "top_k")
    for param in ("stop_token_ids", "allowed_token_ids"):
        check_token_ids(getattr(req, param) or (), card, param)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    try:
        return SamplingParams(
            n=req.n,
            temperature=_default(req.temperature, "temperature", card, 1.0),
            # k >= the vocabulary keeps every token (and fits the wire's uint32).
            top_k=min(_default(req.top_k, "top_k", card, 0), card.vocab_size),
            top_p=_default(req.top_p, "top_p", card, 1.0),
            min_p=_default(req.min_p, "min_p", card, 0.0),
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=_default(req.repetition_penalty, "repetition_penalty", card, 1.0),
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            logit_bias=_logit_bias(req.logit_bias, card),
            allowed_token_ids=req.allowed_token_ids,
            bad_words=tuple(req.bad_words or ()),
            truncate_prompt_tokens=truncate,
            structured_outputs=structured.params if structured is not None else None,
        )
    except FieldError as exc:  # named as the request names it (chat: max_completion_tokens)
        param = names.get(exc.field, exc.field)
        raise bad_request(str(exc).replace(exc.field, param, 1), param) from None
