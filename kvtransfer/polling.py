"""Waiting without spinning: exponential back-off, and a blocking wait built on `poll()`.

The engine loop never needs these (it polls once per step); tests, benchmarks and callers
that have nothing else to do use them instead of a busy loop that would starve the engine on
a small machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Protocol

from kvtransfer.base import TransferResult


class Pollable(Protocol):
    def poll(self) -> list[TransferResult]: ...


class Backoff:
    """Sleeps that double from `min_s` to `max_s`; `reset()` after progress."""

    def __init__(self, min_s: float = 50e-6, max_s: float = 2e-3) -> None:
        self.min_s, self.max_s = min_s, max_s
        self._next = min_s

    def reset(self) -> None:
        self._next = self.min_s

    def sleep(self) -> None:
        time.sleep(self._next)
        self._next = min(self._next * 2, self.max_s)


def wait_for(
    endpoint: Pollable,
    request_ids: Iterable[str],
    timeout_s: float,
    *,
    also_poll: Callable[[], object] | None = None,
    backoff: Backoff | None = None,
) -> dict[str, TransferResult]:
    """Poll `endpoint` until every id in `request_ids` has a result, or `timeout_s` passes.

    Returns every result polled meanwhile (other requests' too: `poll()` reports each result
    once, so none may be thrown away); ids missing from it did not finish in time.
    `also_poll` is called each round (e.g. the other side when both live in one thread).
    """
    wanted = set(request_ids)
    backoff = backoff or Backoff()
    results: dict[str, TransferResult] = {}
    end = time.monotonic() + timeout_s
    while True:
        if also_poll is not None:
            also_poll()
        new = endpoint.poll()
        for r in new:
            results[r.request_id] = r
        if wanted <= results.keys() or time.monotonic() >= end:
            return results
        if new:
            backoff.reset()
        else:
            backoff.sleep()
