"""OpenAI request bodies: the fields this router reads. Other fields are kept in
`model_extra`; router/validation.py refuses the vLLM ones whose effect pdserve lacks and
ignores (with a warning) the rest, as vLLM ignores fields it does not know.

Every route with a JSON body parses it with `parse_json`: strictly (a string where a number
belongs is a type error, never coerced; NaN and infinities are refused), and a refusal is
the OpenAI-shaped 400 naming the field. A body not declared JSON (Content-Type) never gets
here: router/limits.py answers it 415. Ranges are checked
later, by `engine.SamplingParams` and router/validation.py.
"""
from __future__ import annotations

from typing import Any, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router.errors import from_validation_errors

B = TypeVar("B", bound=BaseModel)


def parse_json(model: type[B], body: bytes) -> B:
    """`body` as a `model`, strictly from JSON (an empty body is malformed JSON). Raises the
    400 `APIError` of the first (most specific) error (router.errors.from_validation_errors)."""
    try:
        return model.model_validate_json(body or b"", strict=True)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    """OpenAI's `response_format.json_schema`."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always followed exactly (xgrammar's strict mode)


class LegacyStructure(_Body):
    """vLLM's older structural tag: text between `begin` and `end` follows `schema`."""

    begin: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    end: str


class ResponseFormat(_Body):
    """OpenAI's `response_format` (text, json_object, json_schema) and vLLM's structural_tag:
    `format` (xgrammar's structural tag) or the older `structures` + `triggers`."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[LegacyStructure] | None = None
    triggers: list[str] | None = None


class StructuredOutputs(_Body):
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


class _SamplingFields(_Body):
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
    # Structured outputs (router/structured.py): one of these constrains the output.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None  # vLLM's older names
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True


class TextPart(_Body):
    type: Literal["text"]
    text: str


class OtherPart(_Body):
    type: str


class FunctionCall(_Body):
    name: str
    arguments: str
    """JSON text of the arguments object (as the model wrote it)."""


class MessageToolCall(_Body):
    """A call an earlier assistant turn made (`messages[i].tool_calls[j]`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Union[TextPart, OtherPart]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this is the result of
    reasoning_content: str | None = None  # assistant turns of a reasoning model (vLLM)
    reasoning: str | None = None


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    """One entry of `tools` (OpenAI: function tools only)."""

    type: str
    function: FunctionDefinition | None = None


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call this function."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    documents: list[dict] | None = None
    add_special_tokens: bool = False
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM): either `prompt` or `messages` (+ the chat template fields)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tools: list[ChatTool] | None = None  # rendered as a chat request's tools are
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM)."""

    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM): the name, or the adapter's id (lora_id_for(name))."""

    lora_name: str | None = None
    lora_int_id: int | None = None
