"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Everything the router refuses is an `APIError`; the app maps it (and Starlette's own HTTP
errors, and request-body validation errors) to this body, so a client never sees another shape.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping, Sequence

from fastapi.responses import JSONResponse

log = logging.getLogger(__name__)

REQUEST_ID = "pdserve.request_id"
"""The ASGI scope entry holding the request's id (str), as its `X-Request-Id` header says
(router/http/middleware.py sets it): a 5xx body names it, the log has the details."""

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def worker_failed(request_id: str, exc: BaseException) -> APIError:
    """The 502 a client gets when the workers failed its request: a fixed message naming the
    request id. What failed (the worker, its address, the gRPC status and details: `exc`)
    goes to the log only, so a client learns nothing of the cluster's inside."""
    log.warning("request %s: the workers failed: %s", request_id, exc)
    return APIError(
        502,
        f"The model workers failed to complete this request (request id {request_id}); "
        "retry it, or give the operator the request id.",
        code="worker_failed",
    )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|[A-Z]\w*)$|[\[\]\-]")


def pydantic_param(loc: tuple) -> tuple[str | None, bool]:
    """(field path, whether it stops at a union) from a pydantic error location. Pydantic puts
    the union member tried (`str`, `list[int]`, a model class name) into the location; the
    path ends before it, so `prompt: ["a", 1]` is reported as `prompt`, not `prompt.0`."""
    parts: list[str] = []
    for p in loc:
        if isinstance(p, str) and _TYPE_TAG.search(p):
            return ".".join(parts) or None, True
        parts.append(str(p))
    return ".".join(parts) or None, False


def from_validation_errors(
    errors: Sequence[Mapping[str, Any]],
    tags: Mapping[str, str] | None = None,
    where: str = "this server",
) -> APIError:
    """The one mapper of request-body validation errors: the first (most specific) pydantic
    error as a 400 naming its field.

    Unions are read two ways. A plain union (`prompt: str | list[int] | ...`) ends the path
    at the union (`prompt`, not `prompt.0`). Bodies whose items are tagged unions (`tags`:
    item type -> the tag pydantic puts in the location; /v1/responses) pass through the
    member to the field at fault, and an item `type` the server does not serve is named
    first (`tools.0.type: 'web_search' is not supported by /v1/responses`)."""
    if tags is not None and errors and (refused := _tagged(errors, tags, where)) is not None:
        return refused
    if not errors:
        return bad_request("invalid request body")
    first = min(errors, key=lambda e: (e.get("type") != "missing", -len(e.get("loc", ()))))
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return bad_request(f"request body is not valid JSON: {detail}", code="invalid_json")
    param, union = pydantic_param(tuple(first.get("loc", ())))
    if first.get("type") == "model_type" and not param:
        return bad_request("request body must be a JSON object", code="invalid_json")
    msg = first.get("msg", "invalid value")
    if union:
        msg = f"none of the accepted types matches (e.g. {msg[0].lower() + msg[1:]})"
    return bad_request(f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


def _path(loc: tuple) -> str:
    """`loc` without the union members (`str`, `list[...]`, a tag) pydantic puts in it."""
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and _TYPE_TAG.search(p)))


def _tagged(
    errors: Sequence[Mapping[str, Any]], tags: Mapping[str, str], where: str
) -> APIError | None:
    """The refusal of a body of tagged unions: an unserved `type` first; else the first error
    (a missing field first, then the deepest) at its path through the union members; None
    when the body is not even an object (the plain reading answers)."""
    for e in errors:
        if e["type"] == "union_tag_invalid" or (
            e["type"] == "literal_error" and e["loc"][-1:] == ("type",)
        ):
            param = _path(e["loc"])
            if e["type"] == "union_tag_invalid":
                param += ".type"
                value, expected = e["ctx"]["tag"], _expected_tags(e["ctx"]["expected_tags"], tags)
            else:
                value, expected = e["input"], e["ctx"]["expected"]
            return bad_request(
                f"{param}: {value!r} is not supported by {where} (supported: {expected})",
                param,
                "unsupported_value",
            )
    paths = [_path(e["loc"]) for e in errors]
    first = min(
        range(len(errors)), key=lambda i: (errors[i]["type"] != "missing", -len(errors[i]["loc"]))
    )
    param, message = paths[first], errors[first]["msg"]
    if not param:  # not JSON, not an object
        return None
    if paths.count(param) > 1:  # each member of a union refused the value
        message = f"none of the accepted types matches (e.g. {message[0].lower() + message[1:]})"
    return bad_request(f"{param}: {message}", param, "invalid_value")


def _expected_tags(expected: str, tags: Mapping[str, str]) -> str:
    """pydantic's expected tags ("'Message', 'FunctionCall'") as the item types they stand for."""
    names = {v: k for k, v in tags.items()}
    return ", ".join(repr(names.get(t.strip(" '"), t.strip(" '"))) for t in expected.split(","))
