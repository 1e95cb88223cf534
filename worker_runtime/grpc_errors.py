"""The one mapping from exceptions to gRPC status codes, applied to every servicer method."""
from __future__ import annotations

import functools
import inspect
import logging

import grpc

log = logging.getLogger(__name__)


class Unavailable(RuntimeError):
    """The worker cannot take this now (draining, or a dependency is down)."""


class ResourceExhausted(RuntimeError):
    """No room for the request now (e.g. KV pool full); retry elsewhere or later."""


class FailedPrecondition(RuntimeError):
    """The worker is not in a state that allows the call (e.g. sleep mode not enabled)."""


class NotFound(LookupError):
    """What the call names does not exist (e.g. a LoRA adapter's path)."""


def status_for(exc: BaseException) -> grpc.StatusCode:
    from kvtransfer import IncompatiblePeerError, KVTransferError

    if isinstance(exc, NotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, (ValueError, TypeError, KeyError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, ResourceExhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, FailedPrecondition):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, (TimeoutError,)):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, IncompatiblePeerError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, KVTransferError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def _message(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.strip("'\"") if isinstance(exc, KeyError) else text


async def _abort(context, exc: Exception, method_name: str) -> None:
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("internal error in %s", method_name)
    await context.abort(code, _message(exc))


def grpc_errors(method):
    """Decorate an async servicer method (unary or server-streaming) so that exceptions end
    the call with the mapped status code and the exception's message."""

    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except Exception as exc:
                await _abort(context, exc, method.__name__)
        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as exc:
            await _abort(context, exc, method.__name__)
    return unary
