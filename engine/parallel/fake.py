"""FakeCommunicator: an in-process stand-in for a tensor-parallel group, for single-process
tests of the sharded layers (never used outside tests). Each "rank" is a thread holding its
own FakeCommunicator of one shared `FakeGroup`; collectives meet at a barrier and combine the
ranks' tensors exactly as the real ones do (sum in rank order, concatenation in rank order)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class FakeGroup:
    """The shared state of `size` fake ranks (threads)."""

    def __init__(self, size: int, timeout_s: float = 30.0) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout_s)
        self._slots: list[Any] = [None] * size

    def communicator(self, rank: int) -> "FakeCommunicator":
        return FakeCommunicator(self, rank)

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order (a barrier before and after)."""
        self._slots[rank] = value
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()
        return out

    def run(self, fn: Callable[[int, "FakeCommunicator"], Any]) -> list[Any]:
        """`fn(rank, comm)` on `size` threads at once; their results in rank order (the first
        exception is raised)."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                with torch.inference_mode():
                    results[rank] = fn(rank, self.communicator(rank))
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class FakeCommunicator:
    """The Communicator contract (communicator.py) over a FakeGroup."""

    def __init__(self, group: FakeGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size
        self.calls = 0

    def all_reduce(self, x: torch.Tensor) -> None:
        self.calls += 1
        parts = self.group.exchange(self.rank, x.clone())
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        x.copy_(total)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.calls += 1
        return torch.cat(self.group.exchange(self.rank, x.clone()), dim=dim)

    def broadcast_payload(self, payload: Any = None) -> Any:
        return self.group.exchange(self.rank, payload)[0]
