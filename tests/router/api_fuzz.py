"""Property-based fuzzing of a running router from its own /openapi.json (schemathesis's
Python API: one hypothesis run per operation and generation mode, so the counts are exact).

Every generated request must get: no 5xx; a status, content type and body the schema
declares (schemathesis's checks); negative (schema-violating) data refused with a 4xx; every
error in OpenAI's shape; every 200 body and SSE event valid against router/endpoints/base.py
(the models the schema is built from), a stream ending in `data: [DONE]` (a /v1/responses
stream: events named and numbered in order, ending with the whole response); no more
completion tokens than max_tokens allows, within `request_timeout` seconds.

Cost bound (`cap`): max_tokens / max_completion_tokens / max_output_tokens / n above `cap`
are lowered to it before the call (never a schema violation: the schema sets no maximum), and
with `fill_max_tokens` a generation request without any gets max_tokens (/v1/responses:
max_output_tokens) = cap (a chat request otherwise runs to the end of the context on a real
worker). A positive generation request that leaves `stream` out gets true or false in turn
(the generator rarely makes a streamed request that is valid all through).
"""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from router.endpoints.base import ErrorResponse
from router.endpoints.chat.protocol import ChatCompletionResponse, ChatCompletionStreamChunk
from router.endpoints.completions.protocol import CompletionResponse, CompletionStreamChunk
from router.endpoints.responses.objects import ResponsesResponse, ResponseStreamEvent

GENERATE = {
    "/v1/completions": (CompletionResponse, CompletionStreamChunk),
    "/v1/chat/completions": (ChatCompletionResponse, ChatCompletionStreamChunk),
    "/v1/responses": (ResponsesResponse, ResponseStreamEvent),
}
MAX_TOKENS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def fuzz(
    url: str,
    headers: dict[str, str],
    examples: int,
    cap: int,
    fill_max_tokens: bool = False,
    request_timeout: float = 30.0,
    only: set[str] | None = None,
    skip: frozenset[str] = frozenset(),
    derandomize: bool = True,
) -> Counter:
    """Runs `examples` generated requests per operation and mode (fewer where the space is
    smaller: a GET without parameters is one request); returns counts by
    (mode, path, status, "json" | "sse"). `derandomize`: the same requests every run (CI);
    False explores anew. `skip`: paths the cluster behind `url` cannot serve."""
    doc = httpx.get(url + "/openapi.json", timeout=30).raise_for_status().json()
    schema = schemathesis.openapi.from_dict(doc)
    schema.config.max_stream_events = 1 << 20  # read every stream to its end (default: 20)
    stats: Counter = Counter()
    with requests.Session() as session:
        for result in schema.get_all_operations():
            op = result.ok()
            if (only is not None and op.path not in only) or op.path in skip:
                continue
            # A free-form string path parameter (/v1/models/{id}) has no invalid value.
            has_input = bool(op.body)
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                if mode is GenerationMode.NEGATIVE and not has_input:
                    continue
                _run(
                    op,
                    mode,
                    url,
                    headers,
                    session,
                    examples,
                    cap,
                    fill_max_tokens,
                    request_timeout,
                    stats,
                    derandomize,
                )
    return stats


_STREAM_TURNS: dict[str, int] = {}


def _run(op, mode, url, headers, session, examples, cap, fill, timeout, stats, derandomize) -> None:
    checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=derandomize,
        phases=[Phase.generate],
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
    )
    def one(case) -> None:
        _bound_cost(op.path, case.body, cap, fill)
        if (
            mode is GenerationMode.POSITIVE
            and op.path in GENERATE
            and isinstance(case.body, dict)
            and "stream" not in case.body
        ):
            # Streams get their share: every other case of this path that leaves it out (a
            # per-path turn, so other paths' request counts cannot line it up with failures).
            turn = _STREAM_TURNS[op.path] = _STREAM_TURNS.get(op.path, 0) + 1
            case.body["stream"] = bool(turn % 2)
        start = time.monotonic()
        response = case.call(base_url=url, session=session, headers=headers, timeout=timeout)
        elapsed = time.monotonic() - start
        sse = response.headers.get("content-type", [""])[0].startswith("text/event-stream")
        stats[(mode.value, op.path, response.status_code, "sse" if sse else "json")] += 1
        where = (
            f"{case.as_curl_command()}\n-> {response.status_code} {response.text[:1000]}"
            f" ... {response.text[-1000:]!r}"
        )
        case.validate_response(response, checks=checks, headers=headers)
        assert elapsed <= timeout, where
        _check_body(op.path, case.body, response, cap, where)

    try:
        one()
    except Exception as exc:
        exc.add_note(f"operation: {op.label}, {mode.value}")
        raise


def _bound_cost(path: str, body, cap: int, fill: bool) -> None:
    if path not in GENERATE or not isinstance(body, dict):
        return
    for name in (*MAX_TOKENS, "n"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap
    if fill and all(body.get(name) is None for name in MAX_TOKENS):
        body["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = cap


def _check_body(path: str, body, response, cap: int, where: str) -> None:
    status = response.status_code
    if status >= 400:
        ErrorResponse.model_validate_json(response.content)  # OpenAI's error shape, exactly
        return
    if path not in GENERATE or status != 200:
        return
    whole, chunk = GENERATE[path]
    stream = response.headers["content-type"][0].startswith("text/event-stream")
    if path == "/v1/responses":
        usage = (
            _response_events(response.text, where)
            if stream
            else whole.model_validate_json(response.content).usage
        )
        assert usage.output_tokens <= _max_tokens(path, body, cap), where
        return
    if stream:
        events = [e[len("data: ") :] for e in response.text.split("\n\n") if e]
        assert events and events[-1] == "[DONE]", where
        usage = None
        for data in events[:-1]:
            event = json.loads(data)
            if "error" in event:
                raise AssertionError(f"stream failed: {data}\n{where}")
            usage = chunk.model_validate(event).usage or usage
    else:
        usage = whole.model_validate_json(response.content).usage
    if usage is not None:
        n_choices = body.get("n", 1) * _num_prompts(body)
        assert usage.completion_tokens <= n_choices * _max_tokens(path, body, cap), where


def response_events(text: str, where: str = "") -> list[tuple[str, dict]]:
    """A /v1/responses stream's events as (name, data): each `event: <name>` + `data: <JSON>`,
    valid against ResponseStreamEvent, named as its `type`, numbered 0, 1, ..."""
    out = []
    for i, block in enumerate(b for b in text.split("\n\n") if b):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), where
        event = ResponseStreamEvent.model_validate_json(data[len("data: ") :]).root
        assert name == f"event: {event.type}" and event.sequence_number == i, where
        out.append((event.type, json.loads(data[len("data: ") :])))
    return out


def _response_events(text: str, where: str):
    """A stream ending with the whole response (completed or incomplete): its usage."""
    name, last = response_events(text, where)[-1]
    if name == "response.failed":
        raise AssertionError(f"stream failed: {last}\n{where}")
    assert name in ("response.completed", "response.incomplete"), where
    return ResponseStreamEvent.model_validate(last).root.response.usage


def _num_prompts(body: dict) -> int:
    p = body.get("prompt")
    return len(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else 1


def _max_tokens(path: str, body: dict, cap: int) -> int:
    chosen = next(
        (
            body[k]
            for k in ("max_output_tokens", "max_completion_tokens", "max_tokens")
            if body.get(k) is not None
        ),
        None,
    )
    if chosen is None:  # completions: 16; chat: up to the context (the fake worker: 32)
        return 16 if path == "/v1/completions" else 8192
    return chosen
