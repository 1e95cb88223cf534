"""The sending side of a request: batches of block writes into one peer's pool.

Life cycle of a request here: the first `send` opens it (deadline fixed then — or, with
`idle_s`, a window that every posted or completed write restarts, and that runs only while a
write is outstanding: the sender's own engine computing the next chunk is not a stalled
transfer); each `send` validates its pairs, then posts one write of all of them carrying the
batch notification (a non-final batch without pairs only notifies: the request is open);
while a request with `idle_s` is open and not final, `poll` sends the receiver a keepalive
notification every `heartbeat_interval(idle_s)` seconds;
`poll` checks the posted writes, releasing each handle as it completes; when the final batch
has been posted and every write completed the request is COMPLETE. A failed write, a
disconnected peer, the deadline or `cancel` ends it early: its remaining handles are released
(cancelled) at once. A handle the transport cannot release yet may still be reading the
source blocks and writing the peer's: the request keeps its terminal status but is not
reported by `poll` — so neither side reuses those blocks — until every such handle has been
released on a later poll.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtransfer.base import KVSender, TransferResult, TransferStatus, heartbeat_interval
from kvtransfer.errors import BlockRangeError, DuplicateRequestError, RequestStateError
from kvtransfer.metrics import TransferMetrics
from kvtransfer.protocol import BatchNotice
from kvtransfer.transport import TransportError, TransportHost, WriteState
from kvtransfer.validation import RecentIds, block_pairs


@dataclass(slots=True)
class _Batch:
    handle: Any
    blocks: int
    posted_at: float


@dataclass(slots=True)
class _Request:
    request_id: str
    peer: str
    deadline: float
    started_at: float
    idle_s: float | None = None
    """Progress window (`KVSender.send`); None: `deadline` is fixed."""
    noticed_at: float = 0.0
    """When the receiver was last notified (a batch, or a keepalive)."""
    remote_blocks: set[int] = field(default_factory=set)
    batches: list[_Batch] = field(default_factory=list)
    """Posted writes not yet completed and released."""
    unreleased: list[Any] = field(default_factory=list)
    """Handles of a failed request the transport could not release (cancel) yet: they may
    still move data, so the request is not reported until they are released."""
    next_seq: int = 0
    final_sent: bool = False
    blocks_done: int = 0
    status: TransferStatus = TransferStatus.PENDING
    error: str = ""
    finished_at: float = 0.0
    last_posted_at: float = 0.0
    """When the latest write's post returned (on one host its bytes have landed by then)."""


class Sender(KVSender):
    """KVSender over its backend's transport; see `KVSender` for the contract."""

    def __init__(self, backend: TransportHost) -> None:
        self._b = backend
        self._requests: dict[str, _Request] = {}
        self._recent = RecentIds(backend.config.recent_ids)
        self._zombies: list[Any] = []
        """Handles of completed writes the transport could not free yet (no data moves)."""
        self.metrics = TransferMetrics("send")

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
        with self._b.lock:
            meta = self._b.peer_meta(peer)
            local, remote = block_pairs(pairs, self._b.metadata().num_blocks, meta.num_blocks)
            remote_ids = remote.tolist()
            req = self._requests.get(request_id)
            if req is None:
                if not isinstance(request_id, str) or not request_id:
                    raise RequestStateError(f"request id must be a non-empty str: {request_id!r}")
                if request_id in self._recent:
                    raise DuplicateRequestError(f"request {request_id!r} finished recently")
                if idle_s is not None and not idle_s > 0:
                    raise RequestStateError(f"idle_s must be > 0, not {idle_s!r}")
            elif req.peer != peer:
                raise RequestStateError(
                    f"request {request_id!r} writes to {req.peer!r}, not {peer!r}"
                )
            elif req.status.finished:
                return  # failed before this batch; reported by poll()
            elif req.final_sent:
                raise RequestStateError(f"request {request_id!r} already sent its final batch")
            elif not req.remote_blocks.isdisjoint(remote_ids):
                raise BlockRangeError(f"request {request_id!r} writes a remote block twice")

            now = time.monotonic()
            if req is None:
                if idle_s is not None:
                    deadline = now + idle_s
                elif deadline is None:
                    deadline = now + self._b.config.default_timeout_s
                req = self._requests[request_id] = _Request(request_id, peer, deadline, now, idle_s)
            if not self._b.peer_alive(peer):
                self._finish(req, TransferStatus.ERROR, f"peer {peer!r} is disconnected")
                return
            req.remote_blocks.update(remote_ids)
            total = len(req.remote_blocks) if final else None
            notice = BatchNotice(request_id, req.next_seq, tuple(remote_ids), total).encode()
            req.next_seq += 1
            req.final_sent = final
            req.noticed_at = now
            if req.idle_s is not None:
                req.deadline = now + req.idle_s
            try:
                if remote_ids:
                    handle = self._b.transport.post_write(peer, local, remote, notice, req.deadline)
                    req.batches.append(_Batch(handle, len(remote_ids), now))
                    req.last_posted_at = time.monotonic()
                else:  # the final count, or the request opened: a notification alone
                    self._b.transport.send_notif(peer, notice)
            except TransportError as e:
                if not e.disconnected:
                    self._finish(req, TransferStatus.ERROR, f"write to {peer!r} failed: {e}")
                else:  # fails this and every other request in flight to the peer
                    self._b.mark_peer_dead(peer, f"peer {peer!r} disconnected: {e}")

    def poll(self) -> list[TransferResult]:
        with self._b.lock:
            self._b.pump()
            now = time.monotonic()
            for req in list(self._requests.values()):
                if not req.status.finished:
                    self._advance(req, now)
                    self._keep_alive(req, now)
                elif req.unreleased:
                    req.unreleased = [h for h in req.unreleased if not self._b.transport.release(h)]
            self._zombies = [h for h in self._zombies if not self._b.transport.release(h)]
            return self._collect()

    def status(self, request_id: str) -> TransferStatus | None:
        req = self._requests.get(request_id)
        return None if req is None else req.status

    def cancel(self, request_id: str) -> bool:
        with self._b.lock:
            req = self._requests.get(request_id)
            if req is None or req.status.finished:
                return False
            self._finish(req, TransferStatus.CANCELLED, "cancelled by the sender")
            return True

    @property
    def num_active(self) -> int:
        return len(self._requests)

    @property
    def num_outstanding_writes(self) -> int:
        return sum(len(r.batches) + len(r.unreleased) for r in self._requests.values()) + len(
            self._zombies
        )

    def poll_due_s(self) -> float:
        """How long this sender may go unpolled (the progress thread's pace,
        kvtransfer/progress.py): 0 while a write is outstanding or a finished request waits
        to be reported; else until the next keepalive or fixed deadline of an open request;
        inf with nothing open."""
        with self._b.lock:
            now = time.monotonic()
            due = math.inf
            for req in self._requests.values():
                if req.batches or req.status.finished:
                    return 0.0
                if req.idle_s is None:
                    due = min(due, req.deadline - now)
                elif not req.final_sent:  # no write outstanding: only keepalives are due
                    interval = heartbeat_interval(req.idle_s, self._b.config.heartbeat_s)
                    due = min(due, req.noticed_at + interval - now)
            return max(due, 0.0)

    # -- called by the backend (under its lock) ----------------------------------------
    def fail_peer(self, peer: str, reason: str) -> None:
        for req in self._requests.values():
            if req.peer == peer and not req.status.finished:
                self._finish(req, TransferStatus.ERROR, reason)

    def close(self) -> None:
        for req in self._requests.values():
            if not req.status.finished:
                self._finish(req, TransferStatus.CANCELLED, "backend closed")
            req.unreleased = [h for h in req.unreleased if not self._b.transport.release(h)]
        self._zombies = [h for h in self._zombies if not self._b.transport.release(h)]

    # -- internals ---------------------------------------------------------------------
    def _advance(self, req: _Request, now: float) -> None:
        block_bytes = self._b.metadata().block_bytes
        pending: list[_Batch] = []
        for i, batch in enumerate(req.batches):
            state = self._b.transport.check(batch.handle)
            if state is WriteState.PROC:
                pending.append(batch)
            elif state is WriteState.DONE:
                self._release(batch.handle)
                req.blocks_done += batch.blocks
                if req.idle_s is not None:
                    req.deadline = now + req.idle_s
                self.metrics.record_batch(
                    req.peer, batch.blocks, batch.blocks * block_bytes, now - batch.posted_at
                )
            else:
                req.batches = pending + req.batches[i:]
                self._finish(req, TransferStatus.ERROR, f"a write to {req.peer!r} failed")
                return
        req.batches = pending
        if req.final_sent and not pending:
            self._finish(req, TransferStatus.COMPLETE)
        elif req.idle_s is None and now >= req.deadline:
            self._finish(req, TransferStatus.TIMEOUT, "writes not complete by the deadline")
        elif pending and now >= req.deadline:  # idle_s: only a write in flight can stall
            self._finish(req, TransferStatus.TIMEOUT, f"no write completed for {req.idle_s:g}s")

    def _keep_alive(self, req: _Request, now: float) -> None:
        """Notify the receiver that an open request is still coming (its window restarts)."""
        if req.idle_s is None or req.final_sent or req.status.finished:
            return
        if now - req.noticed_at < heartbeat_interval(req.idle_s, self._b.config.heartbeat_s):
            return
        notice = BatchNotice(req.request_id, req.next_seq, ()).encode()
        req.next_seq += 1
        req.noticed_at = now
        try:
            self._b.transport.send_notif(req.peer, notice)
        except TransportError as e:
            if e.disconnected:
                self._b.mark_peer_dead(req.peer, f"peer {req.peer!r} disconnected: {e}")
            else:
                self._finish(req, TransferStatus.ERROR, f"keepalive to {req.peer!r} failed: {e}")

    def _finish(self, req: _Request, status: TransferStatus, error: str = "") -> None:
        # Only a failed request has batches left here: writes possibly still in flight.
        req.unreleased += [b.handle for b in req.batches if not self._b.transport.release(b.handle)]
        req.batches.clear()
        req.status, req.error, req.finished_at = status, error, time.monotonic()
        if status is TransferStatus.COMPLETE:
            self.metrics.record_completed(req.peer, req.finished_at - req.started_at)
        else:
            self.metrics.record_failure(req.peer, status.name.lower())

    def _release(self, handle: Any) -> None:
        if not self._b.transport.release(handle):
            self._zombies.append(handle)

    def _collect(self) -> list[TransferResult]:
        done = [r for r in self._requests.values() if r.status.finished and not r.unreleased]
        if not done:
            return []
        block_bytes = self._b.metadata().block_bytes
        for r in done:
            del self._requests[r.request_id]
            self._recent.add(r.request_id)
        return [
            TransferResult(
                r.request_id,
                r.status,
                r.peer,
                r.blocks_done,
                r.blocks_done * block_bytes,
                r.finished_at - r.started_at,
                r.error,
                settle_s=r.finished_at - r.last_posted_at if r.last_posted_at else 0.0,
            )
            for r in done
        ]
