"""One supervised child of `pdserve up` (a worker, the router or etcd): a slot that keeps its
role across restarts (a worker's role changes only when the worker switched roles in place,
`up --planner`: it then restarts in the role it had when it died), the restart policy (capped
exponential backoff, crash-loop limit) and what `pdserve status` shows about it.

Life cycle of a slot: STARTING (no child yet: the supervisor's monitor spawns one; then waiting
for it to be ready) -> READY -> the child exits without being asked (a crash) -> RESTARTING
(waiting out the backoff) -> STARTING ... ; more than `max_restarts` crashes within `window`
-> CRASH_LOOP (no more restarts). Scale-in and shutdown move a slot to DRAINING (its child was
asked to stop, so its exit is not a crash) and then STOPPED.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Callable, Protocol

from engine.checks import check_fields
from engine.flags import option


class Child(Protocol):
    """A started child process as the supervisor sees it."""

    @property
    def pid(self) -> int: ...

    def alive(self) -> bool: ...
    def exit_code(self) -> int | None: ...
    def ready(self) -> bool: ...
    def terminate(self) -> int: ...  # asks it to stop (workers drain); SIGKILL after a timeout
    def kill(self) -> None: ...


class SlotState(IntEnum):
    STARTING = 1
    READY = 2
    RESTARTING = 3  # crashed; a new child is started when `restart_at` passes
    CRASH_LOOP = 4  # crashed too often: not restarted any more
    DRAINING = 5  # asked to stop (scale-in, shutdown): its exit is not a crash
    STOPPED = 6

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")

    @property
    def stopping(self) -> bool:
        return self >= SlotState.DRAINING


@dataclass(frozen=True)
class RestartPolicy:
    """When the supervisor restarts a crashed child (`pdserve up`'s restart flags)."""

    startup_timeout: float = option(300.0, name="--startup-timeout")
    """Seconds a process may take to become ready before it counts as crashed (it is
    killed); also how long `up` waits for workers still on their first start."""
    backoff: float = option(1.0, name="--restart-backoff")
    """Seconds before restarting a crashed process, doubled per further crash within
    --restart-window (capped at 30 s)."""
    max_backoff: float = option(30.0, cli=False)
    """Cap of the doubling (never below `backoff`)."""
    max_restarts: int = 5
    """Restarts of one process allowed within --restart-window; one crash more is a crash
    loop and it is not restarted again (0: never restart)."""
    window: float = option(300.0, name="--restart-window")
    """Seconds a crash counts towards --max-restarts and the backoff: a process that stayed
    up this long starts from the first backoff again."""

    def __post_init__(self) -> None:
        check_fields(
            self,
            [
                (self.startup_timeout > 0, "startup_timeout", "must be > 0"),
                (self.backoff >= 0, "backoff", "must be >= 0"),
                (self.max_restarts >= 0, "max_restarts", "must be >= 0"),
                (self.window > 0, "window", "must be > 0"),
            ],
        )

    def delay(self, recent_crashes: int) -> float:
        """Backoff before the restart after the `recent_crashes`-th crash within the window."""
        cap = max(self.max_backoff, self.backoff)
        return min(cap, self.backoff * 2 ** max(0, recent_crashes - 1))


@dataclass(slots=True)
class SlotView:
    """One row of `pdserve status` (and of the control port's GET)."""

    name: str
    role: str
    pid: int | None
    state: str
    restarts: int
    last_exit: int | None


@dataclass
class Slot:
    """Mutated only under the supervisor's lock."""

    name: str  # e.g. decode-2; its log is <log dir>/<name>.log across restarts
    role: str  # prefill, decode, router, etcd; a worker's follows Worker.SetRole (planner)
    spawn: Callable[[], Child]
    state: SlotState = SlotState.STARTING
    child: Child | None = None
    started_at: float = 0.0
    restart_at: float = 0.0
    crashed_at: float = 0.0  # of the last crash (for the time to restore)
    restarts: int = 0  # children started after a crash, over the slot's life
    last_exit: int | None = None
    crashes: list[float] = field(default_factory=list)  # monotonic times within the window

    def on_crash(self, code: int | None, policy: RestartPolicy, now: float) -> float | None:
        """Record a crash; RESTARTING with the delay returned, or CRASH_LOOP (None)."""
        self.last_exit, self.child, self.crashed_at = code, None, now
        self.crashes = [t for t in self.crashes if now - t < policy.window] + [now]
        if len(self.crashes) > policy.max_restarts:
            self.state = SlotState.CRASH_LOOP
            return None
        delay = policy.delay(len(self.crashes))
        self.state, self.restart_at = SlotState.RESTARTING, now + delay
        return delay

    def view(self) -> SlotView:
        pid = self.child.pid if self.child is not None and self.child.alive() else None
        return SlotView(self.name, self.role, pid, self.state.label, self.restarts, self.last_exit)
