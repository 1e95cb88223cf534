"""The KV transfer interface: a backend owning one worker's pool, a sender and a receiver.

Life cycle of a transfer (decode-driven push):

  decode worker D                                  prefill worker P
  ---------------                                  ----------------
  backend.register_pool(kv_cache, compat)          backend.register_pool(kv_cache, compat)
  publish backend.metadata().to_bytes()  ------->  backend.add_peer(metadata_bytes)  (ahead of
                                                   time: compat check + warm connection)
  receiver.expect(tid, [d1..dn], deadline=T)
  send P: tid, D's agent name, [d1..dn]  ------->  after each engine step:
                                                     sender.send(tid, D, [(p_i, d_i), ...],
                                                                 final=last_batch)
  every engine step: receiver.poll()               every engine step: sender.poll()
    -> TransferResult(tid, COMPLETE | TIMEOUT        -> TransferResult(tid, COMPLETE | ...):
       | CANCELLED | ERROR)                             P may now reuse its source blocks

Contract shared by every implementation:

* Nothing blocks the engine loop: `send`, `expect`, `cancel` and `poll` return promptly (a
  backend that copies with the CPU, like NIXL over CMA, copies one batch inside `send`). No
  method sleeps or spins; `kvtransfer.polling.wait_for` is the blocking helper for callers
  that want one.
* Every request ends in exactly one terminal status, reported exactly once by `poll()`; after
  that the implementation holds nothing for it (no block ids, no handles). The sender reports
  a failed request only once none of its writes can still move data: a write handle the
  transport cannot cancel yet is retried on later polls first (see `num_outstanding_writes`),
  so whatever `poll()` reports, the blocks it used may be reused — on both sides. Failures of
  the transfer itself (peer died, deadline passed) are reported this way, never raised.
* Programming errors raise at the call (see `kvtransfer.errors`) and leave no state behind.
* Request ids are transfer-attempt ids: an id that is in flight, or finished among the last
  `KVTransferConfig.recent_ids`, is refused with DuplicateRequestError. Retry with a new id.
* Deadlines are absolute `time.monotonic()` values of the calling process. A request may
  instead follow its progress (`idle_s`): it fails only after `idle_s` seconds in which
  nothing moved — no notification reached the receiver; no posted write of the sender
  completed. While its request is open and not final, a sender keeps the receiver's window
  open with a keepalive notification every `heartbeat_interval(idle_s)` seconds, so a long
  prompt computed on a slow prefill worker never misses a fixed deadline, and a sender
  process that died stops the heartbeats and fails the transfer within `idle_s`.
* Implementations are safe to call from several threads (one internal lock), but are
  designed for one caller: the worker's engine loop.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtransfer.compat import KVCompat
from kvtransfer.metadata import PeerMetadata
from kvtransfer.metrics import TransferMetrics


class TransferStatus(enum.IntEnum):
    """Status of one request's transfer; everything above PENDING is terminal."""

    PENDING = 0
    COMPLETE = 1
    TIMEOUT = 2
    CANCELLED = 3
    ERROR = 4

    @property
    def finished(self) -> bool:
        return self > TransferStatus.PENDING

    @property
    def failed(self) -> bool:
        return self > TransferStatus.COMPLETE


@dataclass(frozen=True, slots=True)
class TransferResult:
    """The terminal outcome of one request, as reported once by `poll()`."""

    request_id: str
    status: TransferStatus
    peer: str | None
    """The other side's agent name (None if a receiver never heard from any sender)."""
    num_blocks: int
    """Blocks written (sender) / landed (receiver) — on success, all of them."""
    num_bytes: int
    elapsed_s: float
    """From the first `send` / from `expect` until the terminal status."""
    error: str = ""
    """Why it failed; empty on success."""
    num_descriptors: int = 0
    """Sender: NIXL descriptors its writes posted (rank 0's; one per coalesced region)."""
    settle_s: float = 0.0
    """Sender: from its last write's post returning to the request's terminal status — the
    transport's acknowledgement (UCX completes a write once the peer's worker progressed;
    on one host the bytes have landed when the post returns). 0 if nothing was posted."""


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """Settings of one worker's transfer backend (part of the worker's frozen config)."""

    agent_name: str | None = None
    """Unique agent name in the cluster; None picks 'pdserve-<random>'."""
    default_timeout_s: float = 30.0
    """Deadline, relative to the first call, of requests given no explicit deadline."""
    recent_ids: int = 4096
    """Finished request ids remembered per side, to refuse reuse and drop late notifications."""
    ucx_net_devices: str | None = "lo"
    """Value for UCX_NET_DEVICES when the environment does not set it ('lo': one host).
    Multi-host clusters set the variable (e.g. 'mlx5_0:1' or 'all') or this field to None."""
    nixl_backends: tuple[str, ...] = ("UCX",)
    """NIXL backend plugins to instantiate."""
    nixl_progress_thread: bool = False
    """NIXL's own progress thread; it spins without delay, so off by default (worker polls)."""
    heartbeat_s: float = 1.0  # kept equal to DEFAULT_HEARTBEAT_S
    """Longest gap between a sender's keepalive notifications for a request open with
    `idle_s` (shorter for short windows: `heartbeat_interval`)."""


DEFAULT_HEARTBEAT_S = 1.0


def heartbeat_interval(idle_s: float, heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> float:
    """Seconds between keepalives of a sender whose receiver fails it after `idle_s` of
    silence: at most a quarter of the window, so one late keepalive never fails it."""
    return min(heartbeat_s, idle_s / 4)


class KVSender(ABC):
    """Writes (local block -> remote block) pairs of a request into a peer's pool.

    A request is opened by its first `send` and is PENDING until its final batch and every
    earlier batch have completed locally (data written, notifications sent); then it is
    COMPLETE and its source blocks may be reused. It fails with ERROR if a write fails or the
    peer disconnects, TIMEOUT if not complete by its deadline, CANCELLED after `cancel`. After
    a failure no further batch of the request is posted and all its handles are released.
    The transport reads the source blocks asynchronously: the caller must not overwrite them
    until `poll()` has reported the request, which for a failed request waits until every
    write handle was cancelled or finished (never on a timer alone).
    """

    metrics: TransferMetrics

    @abstractmethod
    def send(
        self,
        request_id: str,
        peer: str,
        pairs: Sequence[tuple[int, int]],
        *,
        final: bool,
        deadline: float | None = None,
        idle_s: float | None = None,
    ) -> None:
        """Post one batch of writes, asynchronously.

        `pairs` are (local block id, remote block id); each remote block at most once per
        request. The batch's notification tells the receiver which remote blocks landed; the
        final batch's notification also carries the request's total block count (it may
        have no pairs); a batch with no pairs that is not final opens the request (its
        notification tells the receiver the sender is there) and moves nothing.
        `deadline` and `idle_s` are taken from the first batch only: with `idle_s`, the
        request fails only when a posted write makes no progress for `idle_s` seconds, and
        keepalives go out while it is open (module docstring). Raises UnknownPeerError,
        BlockRangeError, DuplicateRequestError (id finished recently) or RequestStateError
        (batch after the final one) without posting anything. A batch for a request that has
        already failed but was not yet reported is ignored.
        """

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """Advance outstanding writes; return the requests that finished since the last call."""

    @abstractmethod
    def status(self, request_id: str) -> TransferStatus | None:
        """Current status; None if the request is unknown or was already reported."""

    @abstractmethod
    def cancel(self, request_id: str) -> bool:
        """Stop a pending request: reported CANCELLED by the next poll, or by a later one if
        a write cannot be cancelled yet (see `poll`). False if not pending."""

    @property
    @abstractmethod
    def num_active(self) -> int:
        """Requests opened and not yet reported by `poll()`."""

    @property
    @abstractmethod
    def num_outstanding_writes(self) -> int:
        """Posted batch writes not yet completed and released (0 when idle: nothing leaked)."""


class KVReceiver(ABC):
    """Tracks, per request, which expected blocks of the local pool have landed.

    A request is opened by `expect`. Each batch notification names the blocks it wrote; the
    data of a batch is in the pool when its notification arrives. The request is COMPLETE only
    when every expected block has landed AND the final notification arrived announcing exactly
    that many blocks. It is TIMEOUT at its deadline otherwise (partially landed blocks are
    never reported complete), ERROR if a notification names an unexpected or repeated block,
    a wrong total, or comes from a second sender, CANCELLED after `cancel`. Notifications
    for unknown or finished requests are dropped and counted. The caller must not read the
    blocks before COMPLETE, and must treat the blocks of a failed request as garbage.
    """

    metrics: TransferMetrics

    @abstractmethod
    def expect(
        self,
        request_id: str,
        block_ids: Sequence[int],
        *,
        deadline: float | None = None,
        peer: str | None = None,
        idle_s: float | None = None,
    ) -> None:
        """Register that `request_id` will write into `block_ids` of our pool.

        With `idle_s` the request times out only after `idle_s` seconds without a
        notification from its sender (keepalives included), or at `deadline` if one is
        given as well; else at `deadline` (default: the config's `default_timeout_s`).
        Must be called before the sender is told the block ids. `peer` (optional) binds the
        request to one sender agent. Raises BlockRangeError for ids outside the pool, repeated
        ids, or ids already expected by another pending request; DuplicateRequestError for an
        id in flight or finished recently.
        """

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """Read notifications, apply deadlines; return requests finished since the last call."""

    @abstractmethod
    def status(self, request_id: str) -> TransferStatus | None:
        """Current status; None if the request is unknown or was already reported."""

    @abstractmethod
    def progress(self, request_id: str) -> tuple[int, int]:
        """(blocks landed, blocks expected) of a request that is not yet reported."""

    @abstractmethod
    def cancel(self, request_id: str) -> bool:
        """Stop waiting (reported CANCELLED by the next poll). False if not pending.

        Writes already in flight from the sender may still land in the blocks: the caller
        keeps them out of reuse until the sending side confirms it stopped (its `poll`
        reported the request; the workers relay that over gRPC)."""

    @property
    @abstractmethod
    def num_active(self) -> int:
        """Requests expected and not yet reported by `poll()`."""


class KVTransferBackend(ABC):
    """One worker's transfer agent: its registered pool, its peers, its sender and receiver."""

    @property
    @abstractmethod
    def agent_name(self) -> str: ...

    @abstractmethod
    def register_pool(self, kv_cache: Any, compat: KVCompat) -> PeerMetadata:
        """Register the worker's KV pool (CPU or CUDA tensor) once; return our metadata.

        Raises PoolError if the tensor does not match `compat` or a pool is registered."""

    @abstractmethod
    def deregister_pool(self) -> None:
        """Forget the registered pool before its memory is freed (sleep mode); transfers
        still in flight are cancelled. `register_pool` may then register it again at its new
        address (new metadata, to be republished)."""

    @abstractmethod
    def metadata(self) -> PeerMetadata:
        """Our metadata (publish `.to_bytes()`); PoolError before `register_pool`."""

    @abstractmethod
    def add_peer(self, metadata: PeerMetadata | bytes) -> str:
        """Load a peer's metadata and connect ahead of the first transfer; return its name.

        Raises MetadataError (malformed, other backend, our own name) or IncompatiblePeerError
        (KV layout differs). Idempotent for identical metadata; new metadata under a known
        name (a restarted peer) replaces the old one, failing requests still in flight to it.
        """

    @abstractmethod
    def remove_peer(self, name: str) -> None:
        """Disconnect a peer; pending sends to it fail with ERROR. Unknown names are ignored."""

    @abstractmethod
    def peers(self) -> list[str]:
        """Names of the peers currently added."""

    @property
    @abstractmethod
    def sender(self) -> KVSender: ...

    @property
    @abstractmethod
    def receiver(self) -> KVReceiver: ...

    @abstractmethod
    def close(self) -> None:
        """Release every handle, peer and registration. Idempotent."""

    def __enter__(self) -> KVTransferBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
