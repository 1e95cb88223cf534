"""One interceptor maps a worker's exceptions to gRPC status codes, unary and streaming:
validation errors are INVALID_ARGUMENT; a TypeError or KeyError from the engine is a bug,
INTERNAL, and logged with its traceback (a real grpc.aio server on loopback)."""

import asyncio
import logging

import grpc
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from worker_runtime.grpc_errors import StatusInterceptor, Unavailable

pytestmark = pytest.mark.timeout(30)


class Raising(pb_grpc.WorkerServicer, pb_grpc.DecodeWorkerServicer):
    """Abort raises what the request id names; Generate streams one reply, then raises."""

    ERRORS = {
        "value": ValueError("max_tokens must be at least 1"),
        "type": TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'"),
        "key": KeyError("layers.7.weight"),
        "unavailable": Unavailable("worker is draining"),
        "timeout": TimeoutError("KV did not arrive"),
    }

    async def Abort(self, request, context):
        if request.request_id == "ok":
            return pb.AbortResponse(found=True)
        raise self.ERRORS[request.request_id]

    async def Generate(self, request, context):
        yield pb.GenerateResponse(token_ids=[1])
        raise self.ERRORS[request.request_id]


async def _calls(kind: str) -> tuple[grpc.StatusCode, str, grpc.StatusCode, str, int]:
    server = grpc.aio.server(interceptors=[StatusInterceptor()])
    servicer = Raising()
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    pb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert (await pb_grpc.WorkerStub(ch).Abort(pb.AbortRequest(request_id="ok"))).found
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await pb_grpc.WorkerStub(ch).Abort(pb.AbortRequest(request_id=kind))
            received = 0
            with pytest.raises(grpc.aio.AioRpcError) as stream:
                async for _ in pb_grpc.DecodeWorkerStub(ch).Generate(
                    pb.GenerateRequest(request_id=kind)
                ):
                    received += 1
    finally:
        await server.stop(0)
    return (
        unary.value.code(),
        unary.value.details(),
        stream.value.code(),
        stream.value.details(),
        received,
    )


@pytest.mark.parametrize(
    "kind, code, details",
    [
        ("value", grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be at least 1"),
        ("unavailable", grpc.StatusCode.UNAVAILABLE, "worker is draining"),
        ("timeout", grpc.StatusCode.DEADLINE_EXCEEDED, "KV did not arrive"),
        (
            "type",
            grpc.StatusCode.INTERNAL,
            "internal error in /pdserve.v1.{service}/{method}: TypeError: unsupported operand",
        ),
        (
            "key",
            grpc.StatusCode.INTERNAL,
            "internal error in /pdserve.v1.{service}/{method}: KeyError: layers.7.weight",
        ),
    ],
)
def test_exceptions_end_calls_with_their_status(kind, code, details, caplog):
    with caplog.at_level(logging.ERROR, logger="worker_runtime.grpc_errors"):
        unary_code, unary_details, stream_code, stream_details, received = asyncio.run(_calls(kind))
    assert (unary_code, stream_code) == (code, code)
    assert unary_details.startswith(details.format(service="Worker", method="Abort"))
    assert stream_details.startswith(details.format(service="DecodeWorker", method="Generate"))
    assert received == 1  # what was streamed before the failure arrived
    internal_logs = [r for r in caplog.records if "internal error" in r.getMessage()]
    if code is grpc.StatusCode.INTERNAL:
        assert len(internal_logs) == 2 and all(r.exc_info for r in internal_logs)
    else:
        assert internal_logs == []
