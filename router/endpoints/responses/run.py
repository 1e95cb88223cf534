"""One /v1/responses request as it runs: its completion's updates (`Delta`s) through chat's
parser of model text (answer, reasoning, tool calls) into the output items (output.py), the
usage, and the response object around them, whole or as server-sent events.

The text is read as chat reads it (router/parsers/message.py's `MessageParser`, with the request's
tools, tool_choice and the server's parsers), so both APIs find the same calls and reasoning.

A stream: `response.created`, `response.in_progress` (the response, `in_progress`, no output
yet), the items' events, then `response.completed` (or `response.incomplete`, cut off by
max_output_tokens) with the whole response; or, when the workers fail after the first token,
`response.failed` (status `failed`, `error` set). Each event is `event: <type>` and
`data: <JSON>` carrying `type` and `sequence_number` (0, 1, ...); no `[DONE]` (OpenAI's
Responses streams have none).
"""

from __future__ import annotations

import json
import time
from typing import Any

from router.call import Delta
from router.endpoints.responses.output import OutputWriter
from router.endpoints.responses.protocol import ResponsesRequest
from router.generation.prepare import Prepared
from router.parsers.message import MessageParser, OutputSetup


class ResponseRun:
    def __init__(
        self,
        req: ResponsesRequest,
        prepared: Prepared,
        response_id: str,
        stored: bool,
        cached_tokens_details: bool,
    ) -> None:
        """`stored`: the response will be kept for previous_response_id.
        `cached_tokens_details`: report cached prompt tokens (--enable-prompt-tokens-details;
        else 0)."""
        self.p = prepared
        # chat's reading of the text: reasoning, tool calls (no setup: all of it is answer)
        self.parser = MessageParser(prepared.output or OutputSetup())
        self.writer = OutputWriter(events=prepared.stream)
        self.id = response_id
        self.details = cached_tokens_details
        self.finish_reason: str | None = None
        self.output_tokens = 0
        self.reasoning_tokens = 0
        self.cached_tokens = 0
        self._sequence = 0
        s = prepared.sampling
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        self._echo = {  # the request as the response object repeats it
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "model": prepared.model,
            "instructions": req.instructions,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": None if req.reasoning is None else req.reasoning.model_dump(),
            "store": stored,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "max_output_tokens": s.max_tokens,
            "text": {
                "format": fmt.model_dump(by_alias=True) if fmt is not None else {"type": "text"}
            },
            "tool_choice": (
                req.tool_choice.model_dump()
                if req.tool_choice is not None and not isinstance(req.tool_choice, str)
                else req.tool_choice or "auto"
            ),
            "tools": [tool.model_dump() for tool in req.tools or ()],
            "truncation": "disabled",
            "user": req.user,
            "background": False,
        }

    def add(self, prompt_idx: int, delta: Delta) -> None:
        """One update of the completion (`prompt_idx` is always 0: one prompt, n = 1)."""
        parsed = self.parser.feed(delta.text)
        if delta.finish_reason:
            parsed.extend(self.parser.finish())
        self.writer.add(parsed)
        tokens = len(delta.token_ids)
        self.output_tokens += tokens
        if (
            parsed.reasoning
            and not (parsed.content or parsed.tool_calls)
            or (not parsed and self.writer.in_reasoning)
        ):
            self.reasoning_tokens += tokens  # tokens whose text went to reasoning
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason
            self.writer.close(incomplete=delta.finish_reason == "length")

    @property
    def status(self) -> str:
        if self.finish_reason is None:
            return "in_progress"
        return "incomplete" if self.finish_reason == "length" else "completed"

    def output(self) -> list[dict[str, Any]]:
        return self.writer.output()

    def response(
        self, status: str | None = None, error: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """The response object (`status`: default the run's)."""
        status = status or self.status
        ended = status != "in_progress"
        prompt = len(self.p.prompts[0])
        usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": self.cached_tokens if self.details else 0},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": prompt + self.output_tokens,
        }
        return {
            **self._echo,
            "status": status,
            "error": error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "output": self.output() if ended else [],
            "usage": usage if ended else None,
        }

    # ---- streaming ------------------------------------------------------------------------
    def opening(self) -> bytes:
        response = self.response("in_progress")
        return self._sse({"type": "response.created", "response": response}) + self._sse(
            {"type": "response.in_progress", "response": response}
        )

    def chunk(self, prompt_idx: int, delta: Delta) -> bytes:
        """`add`, then what it adds to the stream (`take`)."""
        self.add(prompt_idx, delta)
        return self.take()

    def take(self) -> bytes:
        """The items' events since the last call."""
        out = b"".join(map(self._sse, self.writer.events))
        self.writer.events.clear()
        return out

    def closing(self) -> bytes:
        if self.finish_reason is None:  # the stream ended without a finish (never expected)
            self.finish_reason = "stop"
            self.writer.close()
        status = self.status
        return self.take() + self._sse(
            {"type": f"response.{status}", "response": self.response(status)}
        )

    def failed(self, exc: BaseException | str) -> bytes:
        error = {"code": "server_error", "message": str(exc)}
        return self.take() + self._sse(
            {"type": "response.failed", "response": self.response("failed", error)}
        )

    def _sse(self, event: dict[str, Any]) -> bytes:
        event["sequence_number"] = self._sequence
        self._sequence += 1
        data = json.dumps(event, separators=(",", ":"))
        return f"event: {event['type']}\ndata: {data}\n\n".encode()
