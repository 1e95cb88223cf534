"""Calls from this worker to another one: one channel per address, and the wait for a peer's
word that it writes nothing more into our blocks for a transfer.

Both KV paths that write into blocks this worker allocated (a prefill worker pushing a prompt,
a holder sending blocks we pull) end the same way when they fail: our blocks stay out of reuse
until the writer confirmed it stopped, never on a timer (`confirm_stopped`).
"""

from __future__ import annotations

import logging

import grpc

from cluster.grpc_auth import aio_channel
from cluster.grpc_security import ClusterAuth
from cluster.retry import Backoff
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_GONE_AFTER = 3  # UNAVAILABLE answers in a row to an Abort: nothing serves at the address


class PeerChannels:
    """One gRPC channel per peer address, opened on first use and kept."""

    def __init__(self, auth: ClusterAuth) -> None:
        self._auth = auth
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = aio_channel(address, self._auth)
        return channel


async def confirm_stopped(channel: grpc.aio.Channel, request_id: str, timeout_s: float) -> None:
    """Return once the worker behind `channel` writes nothing more for `request_id`: its
    `Worker.Abort` answered (a worker answers once its sender reported the transfer: no
    write of it can land any more). Retried until it answers; only when nothing serves at
    the address (UNAVAILABLE `_GONE_AFTER` times in a row: a dead process writes nothing) is
    the writer taken as stopped without its word, or when it refuses our cluster token
    (UNAUTHENTICATED: a process's token is fixed for its life, so the process serving there
    never ran the transfer; the one that did is gone)."""
    stub = pb_grpc.WorkerStub(channel)
    backoff, unavailable = Backoff(first_s=0.05, max_s=2.0), 0
    while True:
        try:
            await stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout_s)
            return
        except grpc.aio.AioRpcError as err:
            unavailable = unavailable + 1 if err.code() is grpc.StatusCode.UNAVAILABLE else 0
            if unavailable >= _GONE_AFTER or err.code() is grpc.StatusCode.UNAUTHENTICATED:
                return
            log.info("abort of %s: %s; retrying", request_id, err.code().name)
        await backoff.sleep()
