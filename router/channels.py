"""One gRPC channel per worker address, shared by the KV subscription and every request."""
from __future__ import annotations

import grpc

from proto import pdserve_pb2_grpc

_OPTIONS = [
    # A cached-block snapshot is ~34 bytes per block: 1M blocks fit in well under 64 MiB.
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


class ChannelPool:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address, options=_OPTIONS)
        return ch

    def worker(self, address: str) -> pdserve_pb2_grpc.WorkerStub:
        return pdserve_pb2_grpc.WorkerStub(self.channel(address))

    def decode(self, address: str) -> pdserve_pb2_grpc.DecodeWorkerStub:
        return pdserve_pb2_grpc.DecodeWorkerStub(self.channel(address))

    async def close(self, address: str) -> None:
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close(grace=None)

    async def close_all(self) -> None:
        for address in list(self._channels):
            await self.close(address)
