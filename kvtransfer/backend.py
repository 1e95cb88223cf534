"""`TransportBackend`: `KVTransferBackend` over any `Transport` — the part that does not differ
between NIXL and the fake.

It owns pool registration, metadata, the peer table with its compatibility check, and
composes the shared `Sender`/`Receiver` bookkeeping, so the fake exercises exactly the request
state machines NIXL runs. Sender and receiver see it only as a `TransportHost`.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import replace
from typing import Any

from kvtransfer.base import KVTransferBackend, KVTransferConfig, TransferResult
from kvtransfer.compat import KVCompat, check_compatible
from kvtransfer.errors import KVTransferError, MetadataError, PoolError, UnknownPeerError
from kvtransfer.metadata import PeerMetadata
from kvtransfer.protocol import HELLO
from kvtransfer.receiver import Receiver
from kvtransfer.sender import Sender
from kvtransfer.transport import Transport, TransportError

#: Notifications kept for the receiver at most; beyond that the oldest are dropped (a worker
#: that only sends never drains them).
MAX_INBOX = 65536


class TransportBackend(KVTransferBackend):
    """KVTransferBackend over a Transport. See `kvtransfer.base` for the contract."""

    def __init__(self, transport: Transport, agent_name: str, config: KVTransferConfig) -> None:
        self.config = config
        self.lock = threading.RLock()
        self.transport = transport
        self._name = agent_name
        self._peers: dict[str, PeerMetadata] = {}
        self._dead_peers: set[str] = set()
        self._meta: PeerMetadata | None = None
        self._inbox: deque[tuple[str, bytes]] = deque(maxlen=MAX_INBOX)
        self._closed = False
        self._sender: Sender = _CountingSender(self)
        self._receiver = Receiver(self)
        transport.metrics = self._sender.metrics  # what the transport posts is counted there

    # -- KVTransferBackend -------------------------------------------------------------
    @property
    def agent_name(self) -> str:
        return self._name

    @property
    def sender(self) -> Sender:
        return self._sender

    @property
    def receiver(self) -> Receiver:
        return self._receiver

    def register_pool(self, kv_cache: Any, compat: KVCompat) -> PeerMetadata:
        with self.lock:
            self._check_open()
            if self._meta is not None:
                raise PoolError("a KV pool is already registered with this backend")
            heads = self.transport.heads
            compat.check_pool(kv_cache, None if heads is None else heads.count)
            is_cuda = bool(getattr(kv_cache, "is_cuda", False))
            blob = self.transport.register(kv_cache, kv_cache.stride(0) * kv_cache.element_size())
            self._pool = kv_cache  # keep the memory alive while it is registered
            self._meta = PeerMetadata(
                agent_name=self._name,
                backend=self.transport.name,
                compat=compat,
                num_blocks=int(kv_cache.shape[0]),
                base_addr=int(kv_cache.data_ptr()),
                mem_type="VRAM" if is_cuda else "DRAM",
                device_id=int(kv_cache.get_device()) if is_cuda else 0,
                agent_metadata=blob,
                heads=heads,
                ranks=self.transport.rank_pools(),
            )
            return self._meta

    def deregister_pool(self) -> None:
        """Forget the registered pool before its memory is freed (a sleeping engine); a new
        `register_pool` (the pool at its new address: new metadata) may follow. The pool
        must be idle: transfers still in flight are failed."""
        with self.lock:
            self._check_open()
            if self._meta is None:
                return
            self._sender.close()
            self.transport.deregister()
            self._pool = None
            self._meta = None

    def metadata(self) -> PeerMetadata:
        if self._meta is None:
            raise PoolError("no KV pool registered yet: call register_pool first")
        return self._meta

    def add_peer(self, metadata: PeerMetadata | bytes) -> str:
        meta = metadata if isinstance(metadata, PeerMetadata) else PeerMetadata.from_bytes(metadata)
        with self.lock:
            self._check_open()
            local = self.metadata()
            meta.validate()
            if meta.backend != self.transport.name:
                raise MetadataError(
                    f"peer {meta.agent_name!r} uses backend {meta.backend!r}, "
                    f"we use {self.transport.name!r}"
                )
            if meta.agent_name == self._name:
                raise MetadataError(f"peer metadata carries our own agent name {self._name!r}")
            check_compatible(
                local.compat, meta.compat, peer=f"{meta.agent_name!r} (ours: {self._name!r})"
            )
            known = self._peers.get(meta.agent_name)
            if known == meta and meta.agent_name not in self._dead_peers:
                return meta.agent_name
            if known is not None:  # a restarted peer, or one that died: reconnect
                self._drop_peer(meta.agent_name, "peer was replaced by new metadata")
            self.transport.connect(meta)
            self._peers[meta.agent_name] = meta
            try:
                self.transport.send_notif(meta.agent_name, HELLO)  # warm the connection up
            except TransportError as e:
                self._dead_peers.add(meta.agent_name)  # first send reports it per request
                self._sender.fail_peer(meta.agent_name, f"peer unreachable: {e}")
            return meta.agent_name

    def remove_peer(self, name: str) -> None:
        with self.lock:
            if name in self._peers:
                self._drop_peer(name, "peer was removed")

    def peers(self) -> list[str]:
        with self.lock:
            return list(self._peers)

    def close(self) -> None:
        with self.lock:
            if self._closed:
                return
            self._sender.close()
            for name in list(self._peers):
                self._drop_peer(name, "backend closed")
            self.transport.close()
            self._pool = None
            self._closed = True

    # -- TransportHost: used by Sender / Receiver (under self.lock) --------------------
    def peer_meta(self, name: str) -> PeerMetadata:
        meta = self._peers.get(name)
        if meta is None:
            raise UnknownPeerError(f"unknown KV transfer peer {name!r}: add_peer it first")
        return meta

    def peer_alive(self, name: str) -> bool:
        return name in self._peers and name not in self._dead_peers

    def mark_peer_dead(self, name: str, reason: str) -> None:
        self._dead_peers.add(name)
        self._sender.fail_peer(name, reason)

    def pump(self) -> None:
        self._check_open()
        for agent, msg in self.transport.fetch_notifs():
            if msg != HELLO:
                self._inbox.append((agent, msg))

    def take_notifications(self) -> list[tuple[str, bytes]]:
        out = list(self._inbox)
        self._inbox.clear()
        return out

    def _drop_peer(self, name: str, reason: str) -> None:
        self._sender.fail_peer(name, reason)
        self._peers.pop(name, None)
        self._dead_peers.discard(name)
        self.transport.disconnect(name)

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError("KV transfer backend is closed")


class _CountingSender(Sender):
    """The Sender whose results also say how many NIXL descriptors each request's writes
    posted (`TransferResult.num_descriptors`, from `Transport.descriptors_posted`)."""

    def __init__(self, backend: TransportBackend) -> None:
        super().__init__(backend)
        self._host = backend
        self._descriptors: dict[str, int] = {}

    def send(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        with self._host.lock:
            before = self._host.transport.descriptors_posted
            try:
                super().send(request_id, *args, **kwargs)
            finally:
                posted = self._host.transport.descriptors_posted - before
                if posted:
                    self._descriptors[request_id] = self._descriptors.get(request_id, 0) + posted

    def poll(self) -> list[TransferResult]:
        with self._host.lock:
            return [
                replace(r, num_descriptors=self._descriptors.pop(r.request_id, 0))
                for r in super().poll()
            ]
