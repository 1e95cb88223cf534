"""The receiving side of a request: which expected blocks of our pool have landed.

Life cycle of a request here: `expect` reserves its block ids (no other pending request may
expect them) and fixes its deadline — or, with `idle_s`, a deadline that every notification
of its sender (a batch or a keepalive) moves to `idle_s` after it; each batch notification,
which the transport delivers only after that batch's data, marks blocks landed; the final
notification announces the total.
COMPLETE needs every expected block landed and a final total equal to the expected count.
A notification that contradicts the expectation fails the request with ERROR; the deadline
fails it with TIMEOUT; `cancel` with CANCELLED. Once reported by `poll`, the request's block
ids are free to be expected again and later notifications for it are dropped.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtransfer.base import KVReceiver, TransferResult, TransferStatus
from kvtransfer.errors import BlockRangeError, DuplicateRequestError, RequestStateError
from kvtransfer.metrics import TransferMetrics
from kvtransfer.protocol import BatchNotice, decode
from kvtransfer.transport import TransportHost
from kvtransfer.validation import RecentIds, unique_block_ids

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    request_id: str
    expected: frozenset[int]
    deadline: float
    started_at: float
    peer: str | None
    idle_s: float | None = None
    """Progress window: each notification moves the deadline to `idle_s` after it."""
    cap: float = float("inf")
    """An absolute deadline given beside `idle_s`: progress never moves the deadline past it."""
    landed: set[int] = field(default_factory=set)
    total: int | None = None
    """Announced by the final notification."""
    status: TransferStatus = TransferStatus.PENDING
    error: str = ""
    finished_at: float = 0.0


class Receiver(KVReceiver):
    """KVReceiver over its backend's notifications; see `KVReceiver` for the contract."""

    def __init__(self, backend: TransportHost) -> None:
        self._b = backend
        self._requests: dict[str, _Request] = {}
        self._owner: dict[int, str] = {}
        """Block id -> the request expecting it (reserved until that request is reported)."""
        self._recent = RecentIds(backend.config.recent_ids)
        self.metrics = TransferMetrics("receive")

    def expect(
        self,
        request_id: str,
        block_ids: Sequence[int],
        *,
        deadline: float | None = None,
        peer: str | None = None,
        idle_s: float | None = None,
    ) -> None:
        with self._b.lock:
            ids = unique_block_ids(block_ids, self._b.metadata().num_blocks, "expected block ids")
            if not isinstance(request_id, str) or not request_id:
                raise RequestStateError(f"request id must be a non-empty str: {request_id!r}")
            if request_id in self._requests or request_id in self._recent:
                raise DuplicateRequestError(
                    f"request {request_id!r} is in flight or finished recently"
                )
            taken = [b for b in ids.tolist() if b in self._owner]
            if taken:
                raise BlockRangeError(
                    f"blocks {taken[:8]} are already expected by request {self._owner[taken[0]]!r}"
                )
            if idle_s is not None and not idle_s > 0:
                raise RequestStateError(f"idle_s must be > 0, not {idle_s!r}")
            now = time.monotonic()
            cap = float("inf") if deadline is None or idle_s is None else deadline
            if idle_s is not None:
                deadline = min(now + idle_s, cap)
            elif deadline is None:
                deadline = now + self._b.config.default_timeout_s
            req = _Request(request_id, frozenset(ids.tolist()), deadline, now, peer, idle_s, cap)
            self._requests[request_id] = req
            for b in req.expected:
                self._owner[b] = request_id

    def poll(self) -> list[TransferResult]:
        with self._b.lock:
            self._b.pump()
            for agent, msg in self._b.take_notifications():
                self._on_notification(agent, msg)
            now = time.monotonic()
            for req in self._requests.values():
                if not req.status.finished and now >= req.deadline:
                    self._finish(
                        req,
                        TransferStatus.TIMEOUT,
                        f"{len(req.landed)}/{len(req.expected)} blocks landed"
                        f"{'' if req.total is None else ', final notification seen'}"
                        + (
                            " by the deadline"
                            if req.idle_s is None or req.deadline >= req.cap
                            else f", then nothing from the sender for {req.idle_s:g}s"
                        ),
                    )
            return self._collect()

    def status(self, request_id: str) -> TransferStatus | None:
        req = self._requests.get(request_id)
        return None if req is None else req.status

    def progress(self, request_id: str) -> tuple[int, int]:
        req = self._requests[request_id]
        return len(req.landed), len(req.expected)

    def cancel(self, request_id: str) -> bool:
        with self._b.lock:
            req = self._requests.get(request_id)
            if req is None or req.status.finished:
                return False
            self._finish(req, TransferStatus.CANCELLED, "cancelled by the receiver")
            return True

    @property
    def num_active(self) -> int:
        return len(self._requests)

    def poll_due_s(self) -> float:
        """How long this receiver may go unpolled for its own timers (the progress thread's
        pace, kvtransfer/progress.py): until the nearest deadline of a pending request, 0 if
        a finished one waits to be reported, inf with none. A notification may come sooner:
        the progress thread listens on its own period while any request is pending."""
        with self._b.lock:
            now = time.monotonic()
            due = math.inf
            for req in self._requests.values():
                if req.status.finished:
                    return 0.0
                due = min(due, req.deadline - now)
            return max(due, 0.0)

    # -- internals ---------------------------------------------------------------------
    def _on_notification(self, agent: str, msg: bytes) -> None:
        try:
            notice = decode(msg)
        except ValueError as e:
            self.metrics.record_dropped()
            log.warning("dropping KV notification from %r: %s", agent, e)
            return
        if notice is None:
            return
        req = self._requests.get(notice.request_id)
        if req is None or req.status.finished:
            self.metrics.record_dropped()
            return
        problem = self._check_notice(req, agent, notice)
        if problem:
            self._finish(req, TransferStatus.ERROR, problem)
            return
        req.peer = agent
        if req.idle_s is not None:  # the sender is there and moving: the window restarts
            req.deadline = min(time.monotonic() + req.idle_s, req.cap)
        req.landed.update(notice.blocks)
        if notice.blocks:
            self.metrics.record_batch(
                agent, len(notice.blocks), len(notice.blocks) * self._b.metadata().block_bytes, None
            )
        if notice.final:
            req.total = notice.total
        if req.total is not None and len(req.landed) == len(req.expected):
            self._finish(req, TransferStatus.COMPLETE)

    @staticmethod
    def _check_notice(req: _Request, agent: str, notice: BatchNotice) -> str:
        if req.peer is not None and agent != req.peer:
            return f"notification from {agent!r}, but the request is bound to {req.peer!r}"
        unexpected = [b for b in notice.blocks if b not in req.expected]
        if unexpected:
            return f"sender wrote blocks {unexpected[:8]} that were not expected"
        repeated = [b for b in notice.blocks if b in req.landed]
        if repeated or len(set(notice.blocks)) != len(notice.blocks):
            return f"sender wrote blocks {repeated[:8]} more than once"
        if notice.final and req.total is not None:
            return "two final notifications"
        if notice.final and notice.total != len(req.expected):
            return f"sender announced {notice.total} blocks, {len(req.expected)} were expected"
        return ""

    def _finish(self, req: _Request, status: TransferStatus, error: str = "") -> None:
        req.status, req.error, req.finished_at = status, error, time.monotonic()
        peer = req.peer or "unknown"
        if status is TransferStatus.COMPLETE:
            self.metrics.record_completed(peer, req.finished_at - req.started_at)
        else:
            self.metrics.record_failure(peer, status.name.lower())

    def _collect(self) -> list[TransferResult]:
        done = [r for r in self._requests.values() if r.status.finished]
        if not done:
            return []
        block_bytes = self._b.metadata().block_bytes
        results = []
        for r in done:
            del self._requests[r.request_id]
            self._recent.add(r.request_id)
            for b in r.expected:
                del self._owner[b]
            results.append(
                TransferResult(
                    r.request_id,
                    r.status,
                    r.peer,
                    len(r.landed),
                    len(r.landed) * block_bytes,
                    r.finished_at - r.started_at,
                    r.error,
                )
            )
        return results
