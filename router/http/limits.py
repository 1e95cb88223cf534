"""Limits of the HTTP layer, enforced before a route handler sees a request (docs/router.md,
"Limits"):

- a request's head (request line + headers) must arrive within `request_header_timeout_s`
  of the connection opening, or of its previous response: `GuardedH11Protocol` closes the
  connection otherwise (slowloris); h11 already caps a head at 16 KiB;
- a body larger than `max_request_body_bytes` is a 413: at once when its Content-Length says
  so (nothing of it is read, no handler runs), else as soon as the bytes streamed in pass
  the cap (a chunked body); a body not complete `request_body_timeout_s` after the head is a
  408. Both close the connection;
- a POST must declare a JSON body (`application/json` or `application/*+json`), else 415:
  a web page can send `text/plain`, form or bodiless POSTs to a keyless router on loopback
  without a CORS preflight (CSRF), never a JSON one. A bodiless POST without a Content-Type
  and without an `Origin` header (vLLM's `curl -X POST /sleep?level=1`) passes: browsers send
  `Origin` on every POST (Fetch standard), other clients do not.

`uvicorn_options` gives uvicorn its share: the protocol above, `limit_concurrency`,
`timeout_keep_alive`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.config import LimitsConfig
from router.http.errors import APIError

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_json(content_type: bytes) -> bool:
    """`application/json` or `application/<x>+json`, parameters (charset) allowed."""
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


def head_refusal(method: str, headers: dict[bytes, bytes], cap: int) -> APIError | None:
    """The refusal a request's head alone earns (the Content-Type rule; a Content-Length
    over `cap`), or None. `headers`: lower-case names (ASGI). The endpoint picker applies it
    too (router/endpoint_picker/picker.py)."""
    length = headers.get(b"content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        return too_large(cap)
    if method not in _BODY_METHODS:
        return None
    content_type = headers.get(b"content-type")
    if content_type is not None:
        return None if is_json(content_type) else _not_json(content_type)
    bodiless = length in (None, b"0") and b"transfer-encoding" not in headers
    if bodiless and b"origin" not in headers:
        return None
    return _not_json(None)


class RequestLimits:
    """ASGI middleware: the Content-Type rule, the body cap and the body timeout (module
    docstring). Refusals are OpenAI-shaped; one found while the body streams is raised from
    `receive` as an `APIError`, which the app's handler answers."""

    def __init__(self, app, limits: LimitsConfig) -> None:
        self.app = app
        self.cap = limits.max_request_body_bytes
        self.body_timeout_s = limits.request_body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))  # names are lower-case (ASGI)
        refusal = self._refusal(scope["method"], headers)
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        await self.app(scope, self._receive(receive), send)

    def _refusal(self, method: str, headers: dict[bytes, bytes]) -> APIError | None:
        return head_refusal(method, headers, self.cap)

    def _receive(self, receive):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        state = {"read": 0, "done": False}

        async def limited() -> dict[str, Any]:
            if state["done"]:  # the body is in: what follows is the disconnect
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise APIError(
                    408,
                    f"the request body did not arrive within {self.body_timeout_s:g} s",
                    code="request_timeout",
                    headers={"Connection": "close"},
                ) from None
            if message["type"] == "http.request":
                state["read"] += len(message.get("body", b""))
                if state["read"] > self.cap:
                    raise too_large(self.cap)
                state["done"] = not message.get("more_body", False)
            else:
                state["done"] = True
            return message

        return limited


def too_large(cap: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than this server accepts ({cap} bytes; "
        "--max-request-body-bytes)",
        code="request_too_large",
        headers={"Connection": "close"},
    )


def _not_json(content_type: bytes | None) -> APIError:
    got = content_type.decode("latin-1") if content_type is not None else "none"
    return APIError(
        415,
        f"the request body must be JSON: send Content-Type: application/json (got {got})",
        code="unsupported_media_type",
    )


def guarded_h11_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose next request head has not arrived
    within `header_timeout_s` (counted from the connection opening, or from the previous
    response's end)."""

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next head is due too (the keep-alive timer covers idling)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # a whole head arrived
                self._disarm()

        def _arm(self) -> None:
            self._disarm()
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._head_timer = self.loop.call_later(header_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expired(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


def uvicorn_options(limits: LimitsConfig) -> dict[str, Any]:
    """The keyword arguments of `uvicorn.Config` that enforce `limits`."""
    return {
        "http": guarded_h11_protocol(limits.request_header_timeout_s),
        "limit_concurrency": limits.limit_concurrency,
        "timeout_keep_alive": limits.timeout_keep_alive_s,
    }
