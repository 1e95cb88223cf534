"""Compile slots shared fairly by tenants, with a bounded wait: the router's and the workers'
grammar compiles take a slot here before they go to a compile process (one slot per process).

Fairness (start-time fair queueing with unit costs): each tenant with waiting compiles has a
tag; the free slot goes to the smallest tag (ties: the earliest waiter). A grant sets its
tenant's tag to the grant's number; a tenant that starts waiting gets the number of the latest
grant minus one, or the number of its own latest grant if that is larger (it was just
served). So a tenant that starts waiting goes ahead of every tenant that holds a slot or was
served since it started waiting: one tenant's pile of compiles delays another's by at most
the one it is running (with N tenants waiting, by at most one each), and a stream of fresh
tenants cannot overtake a tenant already waiting (ties go to the earlier waiter).

Bounded wait: a caller that gets no slot within `wait_s` is withdrawn and gets `CompileBusy`
(the router answers 503 with Retry-After; a worker RESOURCE_EXHAUSTED). Nothing waits
forever, and nothing is held once its caller is gone: a cancelled waiter is withdrawn, or
gives back the slot it was granted meanwhile.

Thread-safe; `acquire` blocks a thread, `acquire_async` awaits on an event loop (the grant
may come from any thread's `release`)."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Hashable


class CompileBusy(RuntimeError):
    """No compile slot came free within the wait bound."""

    def __init__(self, wait_s: float) -> None:
        super().__init__(
            f"no grammar compile slot came free within {wait_s:g} s (the server's "
            "--grammar-compile-wait); other constraints are compiling, retry later"
        )
        self.wait_s = wait_s


@dataclass(slots=True, eq=False)
class _Waiter:
    tenant: Hashable
    arrival: int
    notify: Callable[[], None]
    granted: bool = False


@dataclass(slots=True)
class _Queue:
    tag: int
    waiters: deque[_Waiter] = field(default_factory=deque)


class FairSlots:
    def __init__(self, slots: int, wait_s: float) -> None:
        """`slots`: compiles at once; `wait_s` (> 0): the longest a caller waits for one."""
        if slots < 1 or wait_s <= 0:
            raise ValueError(f"slots must be >= 1 and wait_s > 0, got {slots}, {wait_s}")
        self.slots = slots
        self.wait_s = wait_s
        self._free = slots
        self._queues: dict[Hashable, _Queue] = {}  # tenants with waiters only: bounded
        self._grants = 0  # slots granted so far; the latest grant's number
        # Grant number of the tenants served last (oldest first; entries older than the
        # previous grant are dropped: they could not raise a tag above `_grants - 1`).
        self._last: OrderedDict[Hashable, int] = OrderedDict()
        self._arrivals = itertools.count()
        self._lock = threading.Lock()
        self.granted_to: deque[Hashable] = deque(maxlen=64)
        """The tenants of the latest grants, oldest first (tests, the benchmark)."""

    def acquire(self, tenant: Hashable) -> None:
        """Blocks until a slot is this caller's, or raises CompileBusy after `wait_s`."""
        event = threading.Event()
        waiter = self._enqueue(tenant, event.set)
        if not waiter.granted and not event.wait(self.wait_s) and self._withdraw(waiter):
            raise CompileBusy(self.wait_s)

    async def acquire_async(self, tenant: Hashable) -> None:
        """`acquire` on an event loop: awaits, never blocks it."""
        loop = asyncio.get_running_loop()
        granted: asyncio.Future[None] = loop.create_future()

        def done() -> None:
            if not granted.done():
                granted.set_result(None)

        def notify() -> None:
            try:
                loop.call_soon_threadsafe(done)
            except RuntimeError:  # its loop is closed: nobody takes the slot
                self.release()

        waiter = self._enqueue(tenant, notify)
        if waiter.granted:  # a free slot: taken at once
            return
        try:
            await asyncio.wait_for(asyncio.shield(granted), self.wait_s)
        except TimeoutError:
            if self._withdraw(waiter):
                raise CompileBusy(self.wait_s) from None
        except BaseException:  # cancelled: the client left
            if not self._withdraw(waiter):
                self.release()
            raise

    def release(self) -> None:
        """Gives a slot back (once per successful acquire)."""
        with self._lock:
            self._free += 1
            notify = self._grant()
        for fn in notify:
            fn()

    def waiting(self) -> int:
        with self._lock:
            return sum(len(q.waiters) for q in self._queues.values())

    def _enqueue(self, tenant: Hashable, notify: Callable[[], None]) -> _Waiter:
        with self._lock:
            waiter = _Waiter(tenant, next(self._arrivals), notify)
            queue = self._queues.get(tenant)
            if queue is None:
                tag = max(self._last.get(tenant, -1), self._grants - 1)
                queue = self._queues[tenant] = _Queue(tag)
            queue.waiters.append(waiter)
            ready = self._grant()
        for fn in ready:
            if fn is not notify:  # granted at once: the caller sees `granted`, no wake-up
                fn()
        return waiter

    def _withdraw(self, waiter: _Waiter) -> bool:
        """Takes a waiter out of its queue; False if it was granted a slot meanwhile."""
        with self._lock:
            if waiter.granted:
                return False
            queue = self._queues[waiter.tenant]
            queue.waiters.remove(waiter)
            if not queue.waiters:
                del self._queues[waiter.tenant]
            return True

    def _grant(self) -> list[Callable[[], None]]:
        """Hands free slots to waiters (the lock held); their notifications, to call after."""
        notify = []
        while self._free and self._queues:
            tenant, queue = min(
                self._queues.items(), key=lambda tq: (tq[1].tag, tq[1].waiters[0].arrival)
            )
            waiter = queue.waiters.popleft()
            self._grants += 1
            queue.tag = self._grants
            self._last[tenant] = self._grants
            self._last.move_to_end(tenant)
            while next(iter(self._last.values())) < self._grants - 1:
                self._last.popitem(last=False)
            if not queue.waiters:
                del self._queues[tenant]
            self._free -= 1
            waiter.granted = True
            self.granted_to.append(tenant)
            notify.append(waiter.notify)
        return notify
