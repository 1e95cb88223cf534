"""The cluster plane's authentication on gRPC servers and channels (the configuration and
its resolution at start: grpc_security.py). Every worker server is built with
`server_interceptors(auth)` first and listens through `add_port`; every channel to a worker
(the router's, a decode worker's to its prefill workers, `pdserve role`, the planner,
benchmarks) comes from `aio_channel` or `channel`.

A token travels as `authorization: Bearer <token>`: as call credentials on a TLS channel,
added by a client interceptor on a plain one (gRPC sends call credentials over TLS only).
"""
from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from cluster.grpc_security import TOKEN_ENV, ClusterAuth

log = logging.getLogger(__name__)

_HEADER = "authorization"
ChannelOptions = Sequence[tuple[str, Any]]


# ---- servers -------------------------------------------------------------------------------

def server_interceptors(auth: ClusterAuth) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors to put first on a server: the token check when there is a token."""
    return [TokenInterceptor(auth.token)] if auth.token is not None else []


def add_port(server: grpc.aio.Server, address: str, auth: ClusterAuth) -> int:
    """Listen on `address`: with TLS, a secure port that requires a client certificate signed
    by the CA; else a plain one. Returns the port (0: could not bind)."""
    if auth.tls is None:
        return server.add_insecure_port(address)
    creds = grpc.ssl_server_credentials([(auth.tls.key, auth.tls.cert)],
                                        root_certificates=auth.tls.ca, require_client_auth=True)
    return server.add_secure_port(address, creds)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call that does not present `authorization: Bearer <token>` with
    UNAUTHENTICATED, before any servicer runs (unary and server-streaming methods: all a
    worker has). A refusal is logged at warning with the caller's address, never a token."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        presented = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == _HEADER:
                presented = value.encode() if isinstance(value, str) else value
        if presented is not None and hmac.compare_digest(presented, self._expected):
            return handler
        reason = "wrong cluster token" if presented is not None else "no cluster token"
        return _refusal(handler, handler_call_details.method, reason)


def _refusal(handler: grpc.RpcMethodHandler, method: str, reason: str) -> grpc.RpcMethodHandler:
    async def refuse(request, context: grpc.aio.ServicerContext) -> None:
        log.warning("refused %s from %s: %s", method, context.peer(), reason)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            f"{reason}: this worker needs the cluster token (--cluster-token-file "
                            f"or {TOKEN_ENV}; docs/security.md)")

    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(refuse, **kw)
    return grpc.unary_unary_rpc_method_handler(refuse, **kw)


# ---- channels ------------------------------------------------------------------------------

def aio_channel(address: str, auth: ClusterAuth, options: ChannelOptions = ()) -> grpc.aio.Channel:
    """An asyncio channel to a worker that presents what `auth` holds: TLS (and the token as
    call credentials) when configured, else a plain channel, with the token added by a client
    interceptor when there is one."""
    if auth.tls is not None:
        return grpc.aio.secure_channel(address, _credentials(auth), options=_options(auth, options))
    interceptors = ([_AioUnaryToken(auth.token), _AioStreamToken(auth.token)]
                    if auth.token is not None else None)
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)


def channel(address: str, auth: ClusterAuth, options: ChannelOptions = ()) -> grpc.Channel:
    """The blocking twin of `aio_channel` (`pdserve role`, the planner, benchmarks)."""
    if auth.tls is not None:
        return grpc.secure_channel(address, _credentials(auth), options=_options(auth, options))
    plain = grpc.insecure_channel(address, options=list(options))
    return grpc.intercept_channel(plain, _SyncToken(auth.token)) if auth.token is not None else plain


def _credentials(auth: ClusterAuth) -> grpc.ChannelCredentials:
    tls = auth.tls
    creds = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key,
                                         certificate_chain=tls.cert)
    if auth.token is None:
        return creds
    return grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(auth.token))


def _options(auth: ClusterAuth, options: ChannelOptions) -> list[tuple[str, Any]]:
    name = auth.tls.server_name if auth.tls is not None else None
    return [*options, *([("grpc.ssl_target_name_override", name)] if name else [])]


class _AioToken:
    """Adds the token to the calls of a plain asyncio channel (grpc.aio files an interceptor
    under one call kind only: one subclass per kind)."""

    def __init__(self, token: str) -> None:
        self._header = (_HEADER, f"Bearer {token}")

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*tuple(details.metadata or ()), self._header)
        return details._replace(metadata=metadata)


class _AioUnaryToken(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class _AioStreamToken(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


@dataclass(frozen=True)
class _SyncDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the token to every unary and server-streaming call of a plain blocking channel."""

    def __init__(self, token: str) -> None:
        self._header = (_HEADER, f"Bearer {token}")

    def _with_token(self, d) -> _SyncDetails:
        return _SyncDetails(d.method, d.timeout, [*(d.metadata or ()), self._header],
                            d.credentials, getattr(d, "wait_for_ready", None),
                            getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)
