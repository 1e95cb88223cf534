"""The fields every generating request shares (completions, chat): sampling, stop, the
vLLM extensions and the structured-output constraints. Ranges are checked later, by
`engine.SamplingParams` and router/generation/prepare.py; `LACKING` lists the vLLM fields
whose effect pdserve lacks (refused by name when set: router/generation/unsupported.py).
"""

from __future__ import annotations

from typing import Any, Callable, Literal

from pydantic import Field

from router.endpoints.base import RequestModel, StreamOptions


def _set(v: Any) -> bool:
    return v is not None


def _true(v: Any) -> bool:
    return bool(v)


LACKING: dict[str, Callable[[Any], bool]] = {
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
"""vLLM request field -> whether its value asks for something pdserve does not do."""


class JsonSchemaFormat(RequestModel):
    """OpenAI's `response_format.json_schema`."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always followed exactly (xgrammar's strict mode)


class LegacyStructure(RequestModel):
    """vLLM's older structural tag: text between `begin` and `end` follows `schema`."""

    begin: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    end: str


class ResponseFormat(RequestModel):
    """OpenAI's `response_format` (text, json_object, json_schema) and vLLM's structural_tag:
    `format` (xgrammar's structural tag) or the older `structures` + `triggers`."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[LegacyStructure] | None = None
    triggers: list[str] | None = None


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs` (engine.structured.StructuredOutputsParams): exactly one
    constraint, plus flags."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None  # refused: xgrammar has no whitespace pattern


class SamplingFields(RequestModel):
    handled_extra = frozenset(LACKING)  # refused by name when set (generation/unsupported.py)

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions (vLLM names), sent by the openai client through extra_body.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    # Structured outputs (router/generation/structured.py): one of these constrains the output.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None  # vLLM's older names
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
