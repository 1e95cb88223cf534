"""One sender or receiver shared by two owners that each poll it.

`poll()` reports a finished request exactly once, so two components polling the same sender
(the prefill streamer and the holder side of a peer pull) would take each other's results.
`split_sender` / `split_receiver` give each owner a view: every call but `poll` goes to the
shared object; `poll` on either view hands out what the shared object reported for that owner.
The shared object is polled once per round — when the calling owner already took its share of
the last poll — so two owners polling after every engine step cost one poll, not two. Owners
are told apart by transfer id: ids that start with `prefix` belong to the second view, every
other id to the first.

A second thread may poll the shared object too (`collect`; kvtransfer/progress.py polls
between engine steps): its results are filed for the owners' next `poll`, and an owner's
listener (`listen`) hears of each of its results at once, on whichever thread collected it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Callable, Generic, TypeVar

from kvtransfer.base import KVReceiver, KVSender, TransferResult, TransferStatus
from kvtransfer.metrics import TransferMetrics

S = TypeVar("S", KVSender, KVReceiver)
Listener = Callable[[TransferResult], None]


class _Split(Generic[S]):
    """The shared source and the results each owner has not taken yet."""

    def __init__(self, source: S, prefix: str) -> None:
        self.source: S = source
        self.prefix = prefix
        self.pending: tuple[list[TransferResult], list[TransferResult]] = ([], [])
        self.taken = [True, True]  # per owner: took its share of the last source poll
        self.listeners: list[Listener | None] = [None, None]
        self.on_work: Callable[[], None] | None = None
        """Told when a transfer starts (a send or an expect): the progress thread's wake-up."""
        self._lock = threading.Lock()  # pending and taken: the owners' thread and `collect`'s

    def poll(self, owner: int) -> list[TransferResult]:
        with self._lock:
            heard = self._poll_source() if self.taken[owner] else []  # a new round
            self.taken[owner] = True
            taken = list(self.pending[owner])
            self.pending[owner].clear()
        self._tell(heard)
        return taken

    def collect(self) -> int:
        """Poll the shared object now (any thread): results wait for their owner's `poll`.
        Returns how many were heard."""
        with self._lock:
            heard = self._poll_source()
        self._tell(heard)
        return len(heard)

    def started(self) -> None:
        if self.on_work is not None:
            self.on_work()

    def _poll_source(self) -> list[TransferResult]:
        results = self.source.poll()
        for result in results:
            self.pending[self._owner_of(result)].append(result)
        self.taken = [False, False]
        return results

    def _owner_of(self, result: TransferResult) -> int:
        return int(result.request_id.startswith(self.prefix))

    def _tell(self, results: list[TransferResult]) -> None:
        for result in results:
            listener = self.listeners[self._owner_of(result)]
            if listener is not None:
                listener(result)


class _View:
    """What both kinds of view add to their interface: the shared object's progress."""

    _split: _Split
    _owner: int

    def collect(self) -> int:
        """Poll the shared object now, for both owners (see `_Split.collect`)."""
        return self._split.collect()

    def listen(self, listener: Listener | None) -> None:
        """Call `listener(result)` for each of this owner's results as soon as it is
        collected, on the collecting thread (the owner's `poll` still returns it)."""
        self._split.listeners[self._owner] = listener

    def on_work(self, callback: Callable[[], None] | None) -> None:
        """Call `callback()` (on the caller's thread) whenever a transfer starts."""
        self._split.on_work = callback


class _SenderView(_View, KVSender):
    def __init__(self, split: _Split[KVSender], owner: int) -> None:
        self._split, self._owner = split, owner

    @property
    def metrics(self) -> TransferMetrics:  # type: ignore[override]
        return self._split.source.metrics

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
        self._split.source.send(
            request_id, peer, pairs, final=final, deadline=deadline, idle_s=idle_s
        )
        self._split.started()

    def poll(self) -> list[TransferResult]:
        return self._split.poll(self._owner)

    def status(self, request_id: str) -> TransferStatus | None:
        return self._split.source.status(request_id)

    def cancel(self, request_id: str) -> bool:
        return self._split.source.cancel(request_id)

    @property
    def num_active(self) -> int:
        return self._split.source.num_active

    @property
    def num_outstanding_writes(self) -> int:
        return self._split.source.num_outstanding_writes

    def poll_due_s(self) -> float:
        """The shared sender's `poll_due_s` (0: poll soon, when it has none)."""
        return _poll_due(self._split.source)


class _ReceiverView(_View, KVReceiver):
    def __init__(self, split: _Split[KVReceiver], owner: int) -> None:
        self._split, self._owner = split, owner

    @property
    def metrics(self) -> TransferMetrics:  # type: ignore[override]
        return self._split.source.metrics

    def expect(
        self,
        request_id: str,
        block_ids: Sequence[int],
        *,
        deadline: float | None = None,
        peer: str | None = None,
        idle_s: float | None = None,
    ) -> None:
        self._split.source.expect(
            request_id, block_ids, deadline=deadline, peer=peer, idle_s=idle_s
        )
        self._split.started()

    def poll(self) -> list[TransferResult]:
        return self._split.poll(self._owner)

    def status(self, request_id: str) -> TransferStatus | None:
        return self._split.source.status(request_id)

    def progress(self, request_id: str) -> tuple[int, int]:
        return self._split.source.progress(request_id)

    def cancel(self, request_id: str) -> bool:
        return self._split.source.cancel(request_id)

    @property
    def num_active(self) -> int:
        return self._split.source.num_active

    def poll_due_s(self) -> float:
        """The shared receiver's `poll_due_s` (inf: no timers known, when it has none)."""
        return _poll_due(self._split.source, math.inf)


def _poll_due(source: object, unknown: float = 0.0) -> float:
    """`source.poll_due_s()`, or `unknown` for a sender or receiver without one."""
    poll_due = getattr(source, "poll_due_s", None)
    return unknown if poll_due is None else float(poll_due())


def split_sender(sender: KVSender, prefix: str) -> tuple[KVSender, KVSender]:
    """(view for every other id, view for ids starting with `prefix`)."""
    split = _Split(sender, prefix)
    return _SenderView(split, 0), _SenderView(split, 1)


def split_receiver(receiver: KVReceiver, prefix: str) -> tuple[KVReceiver, KVReceiver]:
    """(view for every other id, view for ids starting with `prefix`)."""
    split = _Split(receiver, prefix)
    return _ReceiverView(split, 0), _ReceiverView(split, 1)
