"""What every endpoint's bodies share: the one request base class (`RequestModel`, with the
one unknown-field policy), `parse_json`, the one response base class (`ResponseModel`) and the
response pieces several endpoints use (errors, usage, prompt logprobs).

Unknown fields, on every request body and every object inside one (vLLM's `OpenAIBaseModel`):
a field the model does not declare is accepted, kept in `model_extra`, and ignored with one
warning naming it. Exceptions, listed by each model in `handled_extra`: the fields a later
step reads from `model_extra` — known vLLM / OpenAI fields whose effect pdserve lacks, refused
by name when set (router/generation/unsupported.py,
router/endpoints/responses/protocol.py: `check`), never silently ignored.

Every route with a JSON body parses it with `parse_json`: strictly (a string where a number
belongs is a type error, never coerced; NaN and infinities are refused), and a refusal is the
OpenAI-shaped 400 naming the field (router/http/errors.py: `from_validation_errors`). A body not
declared JSON (Content-Type) never gets here: router/http/limits.py answers it 415.

Response models forbid fields they do not declare (the published schema says exactly what
comes back); the router builds plain dicts on the hot path and tests validate them against
these models (tests/router/api_fuzz.py). A field with a default may be left out of a body;
one without is always present (maybe null).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import ClassVar, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from router.http.errors import from_validation_errors

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "tool_calls"]
StopReason = Union[str, int, None]


class RequestModel(BaseModel):
    """The base of every request body and of every object inside one: undeclared fields are
    kept in `model_extra` and ignored with a warning naming them, except `handled_extra`."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    handled_extra: ClassVar[frozenset[str]] = frozenset()
    """Undeclared names a later step reads from `model_extra` (refused by name, not ignored)."""

    @model_validator(mode="after")
    def _warn_unknown(self) -> "RequestModel":
        for name in self.model_extra or ():
            if name not in self.handled_extra:
                _warn_ignored(type(self).__name__, name)
        return self


@lru_cache(maxsize=1024)
def _warn_ignored(model: str, name: str) -> None:
    """Logs once per (model, field name) (bounded, so random names cannot grow memory)."""
    log.warning("request field %r (%s) is not used by this server and is ignored", name, model)


M = TypeVar("M", bound=BaseModel)


def parse_json(model: type[M], body: bytes) -> M:
    """`body` as a `model`, strictly from JSON (an empty body is malformed JSON). Raises the
    400 `APIError` of the first (most specific) error (`from_validation_errors`)."""
    try:
        return model.model_validate_json(body or b"", strict=True)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


class ResponseModel(BaseModel):
    """The base of every response body: undeclared fields are refused (the schema is exact)."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# ---- errors ---------------------------------------------------------------------------------
class ErrorInfo(ResponseModel):
    message: str
    type: str = Field(
        description="invalid_request_error, authentication_error, "
        "not_found_error, server_error, ..."
    )
    param: str | None = Field(description="the request field at fault (`messages.0.role`)")
    code: str | None = Field(description="e.g. context_length_exceeded, invalid_value")


class ErrorResponse(ResponseModel):
    """Every 4xx/5xx body (OpenAI's shape); also a stream's last event before `[DONE]` when
    it fails after the first token."""

    error: ErrorInfo


# ---- shared -----------------------------------------------------------------------------------
class PromptTokensDetails(ResponseModel):
    cached_tokens: int  # prompt tokens served from a prefix cache


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Union[
        PromptTokensDetails, None
    ]  # null unless --enable-prompt-tokens-details


class PromptLogprob(ResponseModel):
    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's prompt_logprobs: null for the first prompt token, then token id -> entry."""


# ---- completions ------------------------------------------------------------------------------


# ---- chat -------------------------------------------------------------------------------------


# ---- side endpoints ---------------------------------------------------------------------------
