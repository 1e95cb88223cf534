"""Transfers move between engine steps: a thread that polls the worker's sender and receiver
while either has a transfer in flight.

Why: UCX advances only inside our calls (kvtransfer/nixl_backend.py), and the engine loop polls
only between steps. A prefill worker's final batch completes once the decode worker has
polled, and the decode worker polls after its decode steps; the prefill worker hears of the
completion after its own next step — a whole prefill of the next prompt. Both waits sat on
the first token's path. This thread polls every `period_s` while anything is in flight and
files the results for the owners' own `poll` after their steps (kvtransfer/poll_split.py);
an owner that listens hears of its results at once (the prefill worker answers its caller
then), and `on_results` is told whenever a round heard any result: the worker wakes its
engine loop with it, so the loop applies a result at once instead of polling every
millisecond while transfers are in flight (event-driven: the decode worker admits a request
whose KV just landed without waiting for a poll tick).

Contract: the thread only calls `collect()` on the views it was given (one per shared
sender or receiver), `num_active` and `on_results`; it sleeps on an event while nothing is in
flight and is woken by a view's `on_work` (a send or an expect starting a transfer).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Protocol, Sequence

log = logging.getLogger(__name__)

DEFAULT_PERIOD_S = 0.001
IDLE_CHECK_S = 0.5  # nothing in flight: look again at least this often (a missed wake-up)


class Collectable(Protocol):
    @property
    def num_active(self) -> int: ...

    def collect(self) -> int:
        """Poll now; return how many results were heard (filed for their owners)."""
        ...

    def on_work(self, callback) -> None: ...


class TransferProgress:
    """Polls `views` every `period_s` while any has a transfer in flight; see the module."""

    def __init__(
        self,
        views: Sequence[Collectable],
        period_s: float = DEFAULT_PERIOD_S,
        on_results: Callable[[], None] | None = None,
    ) -> None:
        self._views = list(views)
        self._period_s = period_s
        self._on_results = on_results
        self._work = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kv-transfer-progress", daemon=True)
        for view in self._views:
            view.on_work(self._work.set)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping = True
        self._work.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _in_flight(self) -> bool:
        return any(view.num_active for view in self._views)

    def _run(self) -> None:
        while not self._stopping:
            self._work.wait(IDLE_CHECK_S)
            self._work.clear()
            while not self._stopping and self._in_flight():
                heard = 0
                for view in self._views:
                    try:
                        heard += view.collect()
                    except Exception:  # a closed backend at shutdown, or a bug: the
                        log.exception("KV transfer progress poll failed")  # engine loop's
                        self._stopping = True  # own polls still run and raise there
                        return
                if heard and self._on_results is not None:
                    self._on_results()
                time.sleep(self._period_s)
