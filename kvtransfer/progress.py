"""Transfers move between engine steps: a thread that polls the worker's sender and receiver
while either has a transfer in flight, as often as what is in flight needs and no more.

Why: UCX advances only inside our calls (kvtransfer/nixl_backend.py), and the engine loop polls
only between steps. A prefill worker's final batch completes once the decode worker has
polled, and the decode worker polls after its decode steps; the prefill worker hears of the
completion after its own next step — a whole prefill of the next prompt. Both waits sat on
the first token's path. This thread polls while anything is in flight and files the results
for the owners' own `poll` after their steps (kvtransfer/poll_split.py); an owner that
listens hears of its results at once (the prefill worker answers its caller then), and
`on_results` is told whenever a round heard any result: the worker wakes its engine loop with
it, so the loop applies a result at once instead of polling every millisecond while transfers
are in flight (event-driven: the decode worker admits a request whose KV just landed without
waiting for a poll tick).

Pace (a poll costs a wake-up and the GIL: on a 2-core host a thread polling every millisecond
for a whole long prompt slows the prefill worker's compute beside it):

* **busy** — a write is outstanding (its completion is heard only by polling), or a round
  just heard a result, or a send / expect was just posted: every `period_s` (1 ms).
* **listening** — a receiver waits for a peer's notification (nothing tells it when one
  comes; the peer's write completes only once we have polled, measured:
  docs/benchmarks/kvtransfer.md): back-off from `period_s`, doubling to `listen_period_s` (5 ms).
* **open** — only senders' requests are open, nothing outstanding (a prefill worker computing
  its next chunk): back-off doubling to `idle_period_s`; never later than a view's own timers
  need (`poll_due_s`: the next keepalive — `heartbeat_interval`, ~1 s — or a deadline).
* **idle** — nothing in flight: the thread sleeps on an event (and looks every
  `IDLE_CHECK_S`, a missed wake-up's bound).

Every sleep is a wait on that event: a view's `on_work` (a send or an expect starting a
transfer) wakes the thread at once and puts it back to `period_s`.

Contract: the thread only calls `collect()` on the views it was given (one per shared
sender or receiver), `num_active`, `num_outstanding_writes` and `poll_due_s` where a view has
them (a view without `num_outstanding_writes` is a receiver's: its requests listen), and
`on_results`.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Callable, Protocol, Sequence

log = logging.getLogger(__name__)

DEFAULT_PERIOD_S = 0.001
LISTEN_PERIOD_S = 0.005
"""A receiver waiting for a notification is polled at least this often: its peer's write
completes only once we polled (UCX's peer error-handling mode, which dead-peer detection
needs), so this bounds what listening adds to the sender's completion — and to the prefill
worker's answer. Measured on the 2-core host: a round costs ~8 us; 1 ms polling ~4.4% of a
core, 5 ms ~1.1%, 10 ms ~0.8% (docs/benchmarks/kvtransfer.md)."""
IDLE_PERIOD_S = 0.5
"""Only senders' requests open, nothing outstanding: at least this often (and as their
keepalives need, `poll_due_s`)."""
IDLE_CHECK_S = 0.5  # nothing in flight: look again at least this often (a missed wake-up)


class Collectable(Protocol):
    @property
    def num_active(self) -> int: ...

    def collect(self) -> int:
        """Poll now; return how many results were heard (filed for their owners)."""
        ...

    def on_work(self, callback) -> None: ...


class TransferProgress:
    """Polls `views` while any has a transfer in flight, at the pace in the module docstring."""

    def __init__(
        self,
        views: Sequence[Collectable],
        period_s: float = DEFAULT_PERIOD_S,
        on_results: Callable[[], None] | None = None,
        *,
        listen_period_s: float = LISTEN_PERIOD_S,
        idle_period_s: float = IDLE_PERIOD_S,
    ) -> None:
        self._views = list(views)
        self._period_s = period_s
        self._listen_s = max(listen_period_s, period_s)
        self._idle_s = max(idle_period_s, period_s)
        self._on_results = on_results
        self._work = threading.Event()
        self._stopping = False
        self.rounds = 0
        """Polling rounds so far (every view collected once per round)."""
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

    def next_sleep(self, backoff_s: float) -> tuple[float, float]:
        """(seconds to sleep before the next round, the back-off after it), given the back-off
        so far: `period_s` while busy; else the back-off, capped by the listening or open
        period and by the views' own timers (`poll_due_s`)."""
        due, listening = math.inf, False
        for view in self._views:
            writes = getattr(view, "num_outstanding_writes", None)
            if writes:
                return self._period_s, self._period_s  # busy: a write's completion to hear
            if writes is None and view.num_active:
                listening = True  # a receiver's request waits for its peer
            poll_due = getattr(view, "poll_due_s", None)
            if poll_due is not None:
                due = min(due, poll_due())
        if due <= 0:
            return self._period_s, self._period_s
        cap = self._listen_s if listening else self._idle_s
        sleep = min(backoff_s, cap, due)
        return sleep, min(2 * backoff_s, cap)

    def _run(self) -> None:
        while not self._stopping:
            self._work.wait(IDLE_CHECK_S)
            self._work.clear()
            backoff = self._period_s
            while not self._stopping and self._in_flight():
                heard = 0
                for view in self._views:
                    try:
                        heard += view.collect()
                    except Exception:  # a closed backend at shutdown, or a bug: the
                        log.exception("KV transfer progress poll failed")  # engine loop's
                        self._stopping = True  # own polls still run and raise there
                        return
                self.rounds += 1
                if heard:
                    backoff = self._period_s  # results come in bursts: look again soon
                    if self._on_results is not None:
                        self._on_results()
                sleep, backoff = self.next_sleep(backoff)
                if self._work.wait(sleep):  # a send or an expect: busy again
                    self._work.clear()
                    backoff = self._period_s
