"""The cluster plane's authentication on gRPC servers and channels (the configuration and
its resolution at start: grpc_security.py). Every worker server is built with
`server_interceptors(auth)` first and listens through `add_port`; every channel to a worker
(the router's, a decode worker's to its prefill workers, `pdserve role`, the planner,
benchmarks) comes from `aio_channel` or `channel`.

A token travels as `authorization: Bearer <token>` metadata that every stub method of the
channel adds, on plain and TLS channels alike (cheaper than a client interceptor or, on TLS,
call credentials: docs/benchmarks/security.md, "gRPC authentication").
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence
from typing import Any

import grpc

from cluster.grpc_security import TOKEN_ENV, ClusterAuth, TlsMaterial

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
    creds = grpc.ssl_server_credentials(
        [(auth.tls.key, auth.tls.cert)], root_certificates=auth.tls.ca, require_client_auth=True
    )
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
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{reason}: this worker needs the cluster token (--cluster-token-file "
            f"or {TOKEN_ENV}; docs/security.md)",
        )

    kw = dict(
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(refuse, **kw)
    return grpc.unary_unary_rpc_method_handler(refuse, **kw)


# ---- channels ----------------------------------------------------------------------------


def aio_channel(address: str, auth: ClusterAuth, options: ChannelOptions = ()) -> grpc.aio.Channel:
    """An asyncio channel to a worker that presents what `auth` holds: mutual TLS when
    configured (else a plain channel), and the token on every call when there is one."""
    if auth.tls is not None:
        ch = grpc.aio.secure_channel(
            address, _credentials(auth.tls), options=_options(auth, options)
        )
    else:
        ch = grpc.aio.insecure_channel(address, options=list(options))
    return _AioTokenChannel(ch, _header(auth.token)) if auth.token is not None else ch


def channel(address: str, auth: ClusterAuth, options: ChannelOptions = ()) -> grpc.Channel:
    """The blocking twin of `aio_channel` (`pdserve role`, the planner, benchmarks)."""
    if auth.tls is not None:
        ch = grpc.secure_channel(address, _credentials(auth.tls), options=_options(auth, options))
    else:
        ch = grpc.insecure_channel(address, options=list(options))
    return _TokenChannel(ch, _header(auth.token)) if auth.token is not None else ch


def _credentials(tls: TlsMaterial) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
    )


def _options(auth: ClusterAuth, options: ChannelOptions) -> list[tuple[str, Any]]:
    name = auth.tls.server_name if auth.tls is not None else None
    return [*options, *([("grpc.ssl_target_name_override", name)] if name else [])]


Header = tuple[str, str]


def _header(token: str) -> Header:
    return (_HEADER, f"Bearer {token}")


class _WithToken:
    """A stub method whose every call carries the token header beside the caller's metadata.
    The token goes on the call itself: a client interceptor would also do it, but grpc.aio
    then relays every streamed message through Python (+20% CPU per 16-message Generate), and
    call credentials cost as much on TLS; this costs one Python call per RPC."""

    __slots__ = ("_method", "_header")

    def __init__(self, method: Any, header: Header) -> None:
        self._method, self._header = method, header

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        return self._method(*args, metadata=(*(metadata or ()), self._header), **kwargs)

    def with_call(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        return self._method.with_call(*args, metadata=(*(metadata or ()), self._header), **kwargs)

    def future(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        return self._method.future(*args, metadata=(*(metadata or ()), self._header), **kwargs)


class _StubMethodsWithToken:
    """The stub-method factories of a channel wrapper: each method carries the token."""

    def __init__(self, channel: Any, header: Header) -> None:
        self._channel, self._header = channel, header

    def unary_unary(self, *args: Any, **kwargs: Any) -> _WithToken:
        return _WithToken(self._channel.unary_unary(*args, **kwargs), self._header)

    def unary_stream(self, *args: Any, **kwargs: Any) -> _WithToken:
        return _WithToken(self._channel.unary_stream(*args, **kwargs), self._header)

    def stream_unary(self, *args: Any, **kwargs: Any) -> _WithToken:
        return _WithToken(self._channel.stream_unary(*args, **kwargs), self._header)

    def stream_stream(self, *args: Any, **kwargs: Any) -> _WithToken:
        return _WithToken(self._channel.stream_stream(*args, **kwargs), self._header)


class _AioTokenChannel(_StubMethodsWithToken, grpc.aio.Channel):
    """An asyncio channel (plain or TLS) whose stub methods all carry the token (`_WithToken`)."""

    async def __aenter__(self) -> "_AioTokenChannel":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._channel.close(None)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()


class _TokenChannel(_StubMethodsWithToken, grpc.Channel):
    """A blocking channel (plain or TLS) whose stub methods all carry the token (`_WithToken`)."""

    def __enter__(self) -> "_TokenChannel":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._channel.close()

    def close(self) -> None:
        self._channel.close()

    def subscribe(self, callback: Any, try_to_connect: bool = False) -> None:
        self._channel.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback: Any) -> None:
        self._channel.unsubscribe(callback)
