"""One gRPC channel per worker address, shared by the KV subscription and every request.

A worker that leaves has its channel retired: closed at once if no request uses it, else
when the last one ends (a worker that lost its etcd lease may still be streaming tokens)."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc

from cluster.grpc_auth import aio_channel
from cluster.grpc_options import CHANNEL_OPTIONS
from cluster.grpc_security import ClusterAuth
from proto import pdserve_pb2_grpc

_OPTIONS = [
    # A cached-block snapshot is ~34 bytes per block: 1M blocks fit in well under 64 MiB.
    ("grpc.max_receive_message_length", 256 << 20),
    *CHANNEL_OPTIONS,
]


class ChannelPool:
    def __init__(self, auth: ClusterAuth) -> None:
        """`auth`: what every channel presents to the workers (the cluster token, TLS)."""
        self.auth = auth
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._users: Counter[str] = Counter()
        self._retiring: set[str] = set()

    def channel(self, address: str) -> grpc.aio.Channel:
        self._retiring.discard(address)  # a worker (re)appeared at this address
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = aio_channel(address, self.auth, _OPTIONS)
        return ch

    def worker(self, address: str) -> pdserve_pb2_grpc.WorkerStub:
        return pdserve_pb2_grpc.WorkerStub(self.channel(address))

    def hold_decode(self, address: str) -> pdserve_pb2_grpc.DecodeWorkerStub:
        """A stub for one request; pair with `release`."""
        stub = pdserve_pb2_grpc.DecodeWorkerStub(self.channel(address))
        self._users[address] += 1
        return stub

    def hold_prefill(self, address: str) -> pdserve_pb2_grpc.PrefillWorkerStub:
        """A stub for one request (embeddings); pair with `release`."""
        stub = pdserve_pb2_grpc.PrefillWorkerStub(self.channel(address))
        self._users[address] += 1
        return stub

    def release(self, address: str) -> None:
        self._users[address] -= 1
        if self._users[address] <= 0:
            del self._users[address]
            if address in self._retiring:
                asyncio.get_running_loop().create_task(self.close(address))

    def retire(self, address: str) -> None:
        if self._users[address] > 0:
            self._retiring.add(address)
        else:
            self._users.pop(address, None)
            asyncio.get_running_loop().create_task(self.close(address))

    async def close(self, address: str) -> None:
        self._retiring.discard(address)
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close(grace=None)

    async def close_all(self) -> None:
        for address in list(self._channels):
            await self.close(address)
