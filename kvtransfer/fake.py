"""An in-process FAKE transfer backend, for unit tests of the workers. Never a default.

Backends on one `FakeFabric` reach each other by agent name. A posted write is in flight until
the sender's next `poll()`, which copies the blocks with `torch` and then queues the
notification on the receiver — the same order a real transport guarantees. The fabric can
kill an agent (its posts and notifications fail with a disconnect, its in-flight writes error)
or stall it (writes towards it stay in flight), and can make an agent's in-flight writes
impossible to cancel for a while (`hold_releases`), to test failure handling without processes.
Everything above the transport (request state machines, checks, metrics) is the real code.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtransfer.backend import TransportBackend
from kvtransfer.base import KVTransferConfig
from kvtransfer.errors import MetadataError
from kvtransfer.metadata import PeerMetadata
from kvtransfer.transport import Transport, TransportError, WriteState


@dataclass(slots=True)
class _Write:
    src: Any
    dst_agent: str
    local: np.ndarray
    remote: np.ndarray
    notif: bytes
    state: WriteState = WriteState.PROC


@dataclass
class FakeFabric:
    """The in-process 'network' joining fake backends."""

    agents: dict[str, FakeTransport] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    stalled: set[str] = field(default_factory=set)
    held: set[str] = field(default_factory=set)

    def kill(self, agent: str) -> None:
        """The agent's process 'died': everything towards it fails from now on."""
        self.dead.add(agent)

    def stall(self, agent: str, stalled: bool = True) -> None:
        """Writes towards the agent stay in flight (a hung link) until un-stalled."""
        (self.stalled.add if stalled else self.stalled.discard)(agent)

    def hold_releases(self, agent: str, held: bool = True) -> None:
        """The agent cannot release (cancel) its writes still in flight until un-held, like a
        NIXL handle that refuses to be released mid-transfer."""
        (self.held.add if held else self.held.discard)(agent)


class FakeTransport(Transport):
    name = "fake"

    def __init__(self, agent_name: str, fabric: FakeFabric) -> None:
        if agent_name in fabric.agents:
            raise ValueError(f"fake agent {agent_name!r} already exists on this fabric")
        self._name = agent_name
        self._fabric = fabric
        self.pool: Any = None
        self.inbox: list[tuple[str, bytes]] = []
        self._peers: set[str] = set()
        self.released_handles = 0
        fabric.agents[agent_name] = self

    def register(self, kv_cache: Any, block_bytes: int) -> bytes:
        self.pool = kv_cache
        return b""

    def deregister(self) -> None:
        self.pool = None

    def connect(self, meta: PeerMetadata) -> None:
        if meta.ranks or meta.heads is not None:
            raise MetadataError(
                f"fake peer {meta.agent_name!r}: the fake moves whole blocks "
                "between single-pool workers only"
            )
        peer = self._fabric.agents.get(meta.agent_name)
        if peer is not None and peer.pool is not None and peer.pool.data_ptr() != meta.base_addr:
            raise MetadataError(f"fake peer {meta.agent_name!r}: pool address mismatch")
        self._peers.add(meta.agent_name)

    def disconnect(self, name: str) -> None:
        self._peers.discard(name)

    def post_write(
        self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes, deadline: float
    ) -> Any:
        self._reachable(peer)
        return _Write(self.pool, peer, local.copy(), remote.copy(), notif)

    def check(self, handle: Any) -> WriteState:
        w: _Write = handle
        if w.state is WriteState.PROC and w.dst_agent in self._fabric.dead:
            w.state = WriteState.ERR
        elif w.state is WriteState.PROC and w.dst_agent not in self._fabric.stalled:
            dst = self._fabric.agents[w.dst_agent]
            if w.remote.min() < 0 or w.remote.max() >= dst.pool.shape[0]:
                raise RuntimeError("fake transport: write outside the destination pool")
            remote, local = torch.from_numpy(w.remote), torch.from_numpy(w.local)
            dst.pool[remote] = w.src[local].to(dst.pool.device)
            dst.inbox.append((self._name, w.notif))
            w.state = WriteState.DONE
        return w.state

    def release(self, handle: Any) -> bool:
        if handle.state is WriteState.PROC and self._name in self._fabric.held:
            return False
        self.released_handles += 1
        return True

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._reachable(peer)
        self._fabric.agents[peer].inbox.append((self._name, msg))

    def fetch_notifs(self) -> list[tuple[str, bytes]]:
        out, self.inbox = self.inbox, []
        return out

    def close(self) -> None:
        self._fabric.agents.pop(self._name, None)

    def _reachable(self, peer: str) -> None:
        if peer not in self._peers:
            raise TransportError(f"fake: {peer!r} not connected")
        if peer in self._fabric.dead or peer not in self._fabric.agents:
            raise TransportError(f"fake: {peer!r} disconnected", disconnected=True)


class FakeTransferBackend(TransportBackend):
    """KVTransferBackend whose transport is a FakeFabric in this process (tests only)."""

    def __init__(self, fabric: FakeFabric, config: KVTransferConfig | None = None) -> None:
        config = config or KVTransferConfig()
        name = config.agent_name or f"fake-{uuid.uuid4().hex[:8]}"
        super().__init__(FakeTransport(name, fabric), name, config)
