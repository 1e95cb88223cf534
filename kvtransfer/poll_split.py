"""One sender or receiver shared by two owners that each poll it.

`poll()` reports a finished request exactly once, so two components polling the same sender
(the prefill streamer and the holder side of a peer pull) would take each other's results.
`split_sender` / `split_receiver` give each owner a view: every call but `poll` goes to the
shared object; `poll` on either view hands out what the shared object reported for that owner.
The shared object is polled once per round — when the calling owner already took its share of
the last poll — so two owners polling after every engine step cost one poll, not two. Owners
are told apart by transfer id: ids that start with `prefix` belong to the second view, every
other id to the first.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

from kvtransfer.base import KVReceiver, KVSender, TransferResult, TransferStatus
from kvtransfer.metrics import TransferMetrics

S = TypeVar("S", KVSender, KVReceiver)


class _Split(Generic[S]):
    """The shared source and the results each owner has not taken yet."""

    def __init__(self, source: S, prefix: str) -> None:
        self.source = source
        self.prefix = prefix
        self.pending: tuple[list[TransferResult], list[TransferResult]] = ([], [])
        self.taken = [True, True]  # per owner: took its share of the last source poll

    def poll(self, owner: int) -> list[TransferResult]:
        if self.taken[owner]:  # a new round: poll the shared object
            for result in self.source.poll():
                self.pending[int(result.request_id.startswith(self.prefix))].append(result)
            self.taken = [False, False]
        self.taken[owner] = True
        taken = list(self.pending[owner])
        self.pending[owner].clear()
        return taken


class _SenderView(KVSender):
    def __init__(self, split: _Split[KVSender], owner: int) -> None:
        self._split, self._owner = split, owner

    @property
    def metrics(self) -> TransferMetrics:  # type: ignore[override]
        return self._split.source.metrics

    def send(self, request_id: str, peer: str, pairs: Sequence[tuple[int, int]], *,
             final: bool, deadline: float | None = None) -> None:
        self._split.source.send(request_id, peer, pairs, final=final, deadline=deadline)

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


class _ReceiverView(KVReceiver):
    def __init__(self, split: _Split[KVReceiver], owner: int) -> None:
        self._split, self._owner = split, owner

    @property
    def metrics(self) -> TransferMetrics:  # type: ignore[override]
        return self._split.source.metrics

    def expect(self, request_id: str, block_ids: Sequence[int], *,
               deadline: float | None = None, peer: str | None = None) -> None:
        self._split.source.expect(request_id, block_ids, deadline=deadline, peer=peer)

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


def split_sender(sender: KVSender, prefix: str) -> tuple[KVSender, KVSender]:
    """(view for every other id, view for ids starting with `prefix`)."""
    split = _Split(sender, prefix)
    return _SenderView(split, 0), _SenderView(split, 1)


def split_receiver(receiver: KVReceiver, prefix: str) -> tuple[KVReceiver, KVReceiver]:
    """(view for every other id, view for ids starting with `prefix`)."""
    split = _Split(receiver, prefix)
    return _ReceiverView(split, 0), _ReceiverView(split, 1)
