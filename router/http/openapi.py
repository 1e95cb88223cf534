"""What /openapi.json says about each route: its request body and its responses, from the
pydantic models the router parses with (router/endpoints/sampling.py) and the ones describing what
it
emits (router/endpoints/base.py).

Handlers parse the raw body with `router.endpoints.base.parse_json` rather than take a FastAPI
body parameter: FastAPI answers an empty body "Field required" instead of malformed JSON, lets lone
surrogates (`"\\ud800"`) through to the tokenizer, validates in Python mode after `json.loads`
and costs more instructions per request (docs/benchmarks/router.md, "Router HTTP layer"). So the
request schema is published through `openapi_extra`, and responses through `responses=` —
never `response_model`, which would re-serialize every body. A route declares both in one
line:

    @app.post("/v1/embeddings", **route_schema(EmbeddingRequest, EmbeddingResponse,
                                               errors=GENERATE_ERRORS))

`install_openapi(app)` (once, in create_app) moves the models' nested definitions into
`components/schemas` and drops FastAPI's 422 (the router never answers it).
"""

from __future__ import annotations

from typing import Any, Iterable

from fastapi import FastAPI
from pydantic import BaseModel

from router.endpoints.base import ErrorResponse

_REF = "#/components/schemas/{model}"

_ERROR_TEXT = {
    400: "Malformed JSON, a wrong type, an out-of-range value, a prompt that does not fit "
    "the context (`code: context_length_exceeded`) or an unsupported feature; `param` "
    "names the field",
    401: "Missing or wrong API key (`--api-key`)",
    403: "An inference key on an admin endpoint: it needs `--admin-api-key`",
    404: "Unknown model",
    500: "Internal error (fixed message; the detail goes to the router's log)",
    502: "Workers failed before the first token, even after the retry",
    429: "This API key is at its per-key limit (`--max-concurrent-requests-per-key`, "
    "`--max-tokens-per-minute-per-key`; `code: rate_limit_exceeded`, `Retry-After` header)",
    503: "No worker had room within `--queue-timeout` (`Retry-After` header)",
    408: "The body did not arrive within `--request-body-timeout`",
    413: "The body is larger than `--max-request-body-bytes`",
    415: "The body is not declared JSON (`Content-Type: application/json`)",
}
BODY_ERRORS = (408, 413, 415)
"""The statuses of every route with a request body (router/http/limits.py), declared with it."""
STREAM_TEXT = (
    "; with `stream: true`, server-sent events: `data: <chunk JSON>` each, or an "
    "error body when the request fails after its first token, then `data: [DONE]`"
)
TYPED_STREAM_TEXT = (
    "; with `stream: true`, server-sent events: `event: <type>` and "
    "`data: <event JSON>` each (its `type` and `sequence_number` inside), "
    "ending with response.completed, response.incomplete or "
    "response.failed; no `[DONE]`"
)
GENERATE_ERRORS = (400, 401, 404, 429, 500, 502, 503)
"""The statuses of a /v1 route that prepares a request and runs it on workers."""
SIDE_ERRORS = (400, 401, 404, 500)
"""The statuses of /tokenize-like routes (no worker involved)."""


def schema_ref(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema as a `$ref` into components; its definitions travel along under
    `$defs` until `install_openapi` moves them there."""
    schema = model.model_json_schema(ref_template=_REF)
    defs = schema.pop("$defs", {})
    return {"$ref": _REF.format(model=model.__name__), "$defs": {**defs, model.__name__: schema}}


def route_schema(
    request: type[BaseModel] | None = None,
    ok: type[BaseModel] | None = None,
    *,
    stream: type[BaseModel] | None = None,
    typed_events: bool = False,
    errors: Iterable[int] = (),
    ok_description: str = "Success",
) -> dict[str, Any]:
    """Keyword arguments for a FastAPI route decorator. `request`: the JSON body (required);
    `ok`: the 200 body; `stream`: one SSE `data:` event when the body asks for
    `stream: true` (200 as `text/event-stream`); `typed_events`: the stream is the Responses
    API's (each event named by an `event:` line, no `[DONE]`, failures as events); `errors`:
    the statuses answered with an OpenAI error body (with a request body, BODY_ERRORS too)."""
    responses: dict[int | str, dict[str, Any]] = {}
    if ok is not None:
        responses[200] = {"model": ok, "description": ok_description}
    if stream is not None:
        ok_response = responses.setdefault(200, {"description": ok_description})
        ok_response["description"] += TYPED_STREAM_TEXT if typed_events else STREAM_TEXT
        item = _typed_event(stream) if typed_events else _sse_event(stream)
        ok_response["content"] = {"text/event-stream": {"itemSchema": item}}
    for status in (*errors, *(BODY_ERRORS if request is not None else ())):
        responses[status] = {"model": ErrorResponse, "description": _ERROR_TEXT[status]}
    out: dict[str, Any] = {"response_model": None, "responses": responses}
    if request is not None:
        out["openapi_extra"] = {
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": schema_ref(request)}},
            }
        }
    return out


def _sse_event(chunk: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI 3.2's itemSchema for `text/event-stream`: one event, whose `data` is a chunk's
    or an error's JSON, or the final `[DONE]`."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [schema_ref(chunk), schema_ref(ErrorResponse)]},
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
    }


def _typed_event(event: type[BaseModel]) -> dict[str, Any]:
    """An event named by its `event:` line, whose `data` is an `event` as JSON."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": schema_ref(event),
    }
    return {
        "type": "object",
        "required": ["event", "data"],
        "properties": {"event": {"type": "string"}, "data": json_data},
    }


def install_openapi(app: FastAPI) -> None:
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _finish(generate())  # generate() stores the schema as app.openapi_schema
        assert app.openapi_schema is not None
        return app.openapi_schema

    setattr(app, "openapi", openapi)  # FastAPI's documented way to customize the schema


def _finish(doc: dict[str, Any]) -> None:
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    _hoist_defs(doc["paths"], components)
    for operations in doc["paths"].values():
        for op in operations.values():
            ref = (
                op.get("responses", {})
                .get("422", {})
                .get("content", {})
                .get("application/json", {})
                .get("schema", {})
                .get("$ref", "")
            )
            if ref.endswith("/HTTPValidationError"):
                del op["responses"]["422"]
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


def _hoist_defs(node: Any, components: dict[str, Any]) -> None:
    if isinstance(node, dict):
        for name, schema in node.pop("$defs", {}).items():
            components.setdefault(name, schema)
        for value in node.values():
            _hoist_defs(value, components)
    elif isinstance(node, list):
        for value in node:
            _hoist_defs(value, components)
