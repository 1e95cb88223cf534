"""The ASGI middleware every request passes (inside it, router/http/limits.py's
`RequestLimits`): the Host / Origin check, the back-off of addresses that keep presenting wrong
keys, the key check, the per-key concurrency slot, requests counted by endpoint and status, and
the `X-Request-Id` header."""

from __future__ import annotations

import uuid
from typing import Any

from router.endpoints.admin.serving import ADMIN_PATHS
from router.http.auth import KEY_CHECKED, Access, access_of, authorize
from router.http.auth_throttle import FailedAuthThrottle, client_of
from router.http.errors import REQUEST_ID, APIError
from router.http.host_check import HostCheck
from router.http.key_limits import LIMITED_PATHS, TENANT, TICKET
from router.services import Services

_ENDPOINTS = {
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/models",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/version",
    "/v1/embeddings",
    "/dashboard",
    "/dashboard/data",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    *ADMIN_PATHS,
}
"""The paths counted by name (`/v1/models/{id}` and "other" for the rest)."""


class AuthAndCount:
    """ASGI middleware: the Host / Origin check (router/http/host_check.py: 421 / 403), the
    back-off of an address after repeated wrong keys (router/http/auth_throttle.py: 429), the
    key check (router/http/auth.py: which paths need which key), the
    per-key concurrency slot of a request to a worker path (router/http/key_limits.py: taken
    before the body is read, released once the response is over — a stream's end, the client
    gone, an error — which also reconciles the key's tokens), requests counted by endpoint
    and status (499: the client went away first), and every response carries an
    `X-Request-Id` header: the request's own, or a fresh one (also in `scope[REQUEST_ID]`)."""

    def __init__(self, app: Any, services: Services) -> None:
        self.app = app
        self.services = services
        config = services.config
        # Only inference keys close the model: with an admin key alone, /v1/* stays open.
        keyed = bool(services.keys.api)
        self.hosts = HostCheck(config.host, config.allowed_hosts, keyed=keyed)
        self.throttle = FailedAuthThrottle()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = (
            path
            if path in _ENDPOINTS
            else "/v1/models/{id}"
            if path.startswith("/v1/models/")
            else "other"
        )
        status = {"code": 499}
        request_id = (
            next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
            or uuid.uuid4().hex.encode()
        )

        async def counting_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {
                    **message,
                    "headers": [*message.get("headers", ()), (b"x-request-id", request_id)],
                }
            await send(message)

        scope[REQUEST_ID] = request_id.decode("latin-1")
        try:
            denied = self.hosts.check(scope)
            if denied is None and self.throttle and access_of(path) is not Access.OPEN:
                denied = self.throttle.refused(client_of(scope))  # an address backing off
            if denied is None:
                denied = authorize(self.services.keys, scope)
                if denied is not None and denied.status == 401:
                    self.throttle.failed(client_of(scope))
                elif denied is None and self.throttle and scope.get(KEY_CHECKED):
                    self.throttle.succeeded(client_of(scope))
            if denied is not None:
                await denied.response()(scope, receive, counting_send)
                return
            limits = self.services.key_limits
            try:
                ticket = limits.admit(scope.get(TENANT)) if path in LIMITED_PATHS else None
            except APIError as refused:
                await refused.response()(scope, receive, counting_send)
                return
            scope[TICKET] = ticket
            try:
                await self.app(scope, receive, counting_send)
            finally:
                limits.release(ticket, served=status["code"] < 500)
        finally:
            self.services.metrics.requests.labels(endpoint, str(status["code"])).inc()
