"""A registration the router has not accepted never gets a channel carrying the cluster token:
one that does not fit the registration check, one outside --allowed-worker-cidrs, and one
first seen draining. Each "worker" here is a bare TCP listener that records who connects; a
worker registered after them is the control (its listener does get the router's KV-event
subscription's connection)."""

import asyncio
import json
import socket

from router_harness import wait_for

from cluster.grpc_security import ClusterAuth
from cluster.registration import WorkerInfo, parse_registration, workers_prefix
from router.channels import ChannelPool
from router.placement.allowed_workers import AllowedWorkers, parse_network
from router.placement.events import KVSubscriptions
from router.placement.index import KVIndex
from router.placement.registry import WorkerRegistry

TOKEN = "forged-registration-test-token-0123456789"


class Listener:
    """A TCP port that accepts and keeps what the first connection sends."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen()
        self.sock.setblocking(False)
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.received = b""
        self.connections = 0

    def poll(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            pass
        else:
            self.connections += 1
            conn.settimeout(2)
            try:
                self.received += conn.recv(65536)
            except OSError:
                pass
            conn.close()
        self.sock.setblocking(False)

    def close(self) -> None:
        self.sock.close()


def _info(worker_id: str, address: str, draining: bool = False) -> WorkerInfo:
    return WorkerInfo(worker_id, "decode", address, "m", "c", 16, draining=draining)


def test_no_channel_carries_the_token_to_a_registration_not_accepted():
    async def main():
        prefix = workers_prefix("c")
        allowed = AllowedWorkers((parse_network("127.0.0.0/8"),))
        registry = WorkerRegistry(refusal=allowed.refusal)
        channels = ChannelPool(ClusterAuth(token=TOKEN))
        subs = KVSubscriptions(KVIndex(), channels)
        registry.add_listener(subs.on_added, subs.on_removed)
        malformed, draining, good = Listener(), Listener(), Listener()
        try:
            doc = json.loads(_info("bad", malformed.address).to_json())
            doc["capacity"] = {"total_blocks": -1}
            key = prefix + b"decode/bad"
            assert parse_registration(key, json.dumps(doc).encode(), prefix) is None
            # outside --allowed-worker-cidrs (a listener there would be on another host)
            registry.put(_info("outside", "10.9.9.9:50051"))
            registry.put(_info("draining", draining.address, draining=True))
            registry.put(_info("good", good.address))

            def polled():
                for listener in (malformed, draining, good):
                    listener.poll()
                return good.connections > 0

            await wait_for(polled, timeout=10)
            assert set(channels._channels) == {good.address}
            assert malformed.connections == draining.connections == 0
            assert registry.refused["outside"].reason == "refused"
        finally:
            await subs.close()
            await channels.close_all()
            for listener in (malformed, draining, good):
                listener.close()

    asyncio.run(main())
