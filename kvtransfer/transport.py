"""The part of a backend that differs between NIXL and the fake, and what the shared request
state machines need of the backend that owns them.

`Transport` is the narrow, backend-specific layer: post a batch of block writes carrying a
notification, check and release it, send a standalone notification, read notifications.
`TransportHost` is what `Sender` and `Receiver` use of their backend; `TransportBackend`
(kvtransfer.backend) implements it and composes them, so neither imports the backend.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from kvtransfer.base import KVTransferConfig
from kvtransfer.errors import KVTransferError
from kvtransfer.heads import HeadRange
from kvtransfer.metadata import PeerMetadata, RankPool
from kvtransfer.metrics import TransferMetrics


class WriteState(enum.Enum):
    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


class TransportError(KVTransferError):
    """A post or notification failed; `disconnected` if the peer is gone for good."""

    def __init__(self, message: str, disconnected: bool = False) -> None:
        super().__init__(message)
        self.disconnected = disconnected


class Transport(ABC):
    """Backend-specific moves. Called only under the owning backend's lock."""

    name: str
    """Backend name written into metadata ('nixl', 'fake')."""
    metrics: TransferMetrics | None = None
    """The sender's metrics, where a transport records what it posts (`record_post`); set by
    the backend that owns both."""
    descriptors_posted: int = 0
    """NIXL descriptors posted so far by this process (0: a transport without them)."""

    @abstractmethod
    def register(self, kv_cache: Any, block_bytes: int) -> bytes:
        """Register the pool, one descriptor per block; return the opaque metadata blob."""

    @property
    def heads(self) -> HeadRange | None:
        """The KV heads our pool holds (rank 0's of a tensor-parallel worker); None: all."""
        return None

    def rank_pools(self) -> tuple[RankPool, ...]:
        """A tensor-parallel worker's other ranks' pools, registered by `register`."""
        return ()

    def deregister(self) -> None:
        """Forget the registered pool (before its memory is freed); `register` may follow."""

    @abstractmethod
    def connect(self, meta: PeerMetadata) -> None:
        """Load a peer and start connecting (no waiting). MetadataError if unusable."""

    @abstractmethod
    def disconnect(self, name: str) -> None:
        """Forget a peer; in-flight handles towards it must be released first."""

    @abstractmethod
    def post_write(
        self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes, deadline: float
    ) -> Any:
        """Start writing local blocks into remote blocks; `notif` reaches the peer after the
        data. Returns a handle; TransportError if it cannot be posted. `deadline` (the
        request's): when writes posted by other processes (a tensor-parallel worker's other
        ranks) give up on their own."""

    @abstractmethod
    def check(self, handle: Any) -> WriteState: ...

    @abstractmethod
    def release(self, handle: Any) -> bool:
        """Free a handle (cancelling it if still in flight). False if it cannot be freed yet."""

    @abstractmethod
    def send_notif(self, peer: str, msg: bytes) -> None:
        """A notification without data. TransportError if the peer is unreachable."""

    @abstractmethod
    def fetch_notifs(self) -> list[tuple[str, bytes]]:
        """New (sender agent name, message) pairs; also drives the transport's progress."""

    @abstractmethod
    def close(self) -> None: ...


class TransportHost(Protocol):
    """The backend as `Sender` and `Receiver` see it. Call everything under `lock`."""

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """Re-entrant; guards the transport, the peer table and both state machines."""

    config: KVTransferConfig
    transport: Transport

    def metadata(self) -> PeerMetadata:
        """Our own pool's metadata; PoolError before `register_pool`."""

    def peer_meta(self, name: str) -> PeerMetadata:
        """A peer's metadata; UnknownPeerError if it was never added (or was removed)."""

    def peer_alive(self, name: str) -> bool: ...

    def mark_peer_dead(self, name: str, reason: str) -> None:
        """The transport said the peer is gone: fail everything in flight to it."""

    def pump(self) -> None:
        """Drive transport progress; keep data notifications for the receiver."""

    def take_notifications(self) -> list[tuple[str, bytes]]:
        """Data notifications (sender agent name, message) received since the last call."""
