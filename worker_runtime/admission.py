"""The worker's state: one phase, the role it serves, and the calls in flight.

Life cycle of a worker's phase (every move is in `_NEXT`; anything else is a bug):

    SERVING ──Sleep──> GOING_TO_SLEEP ──drained, pool freed──> SLEEPING ──WakeUp──> SERVING
       │ └───UpdateWeights──> UPDATING_WEIGHTS ──done or failed──> SERVING
       └─────SetRole──> SWITCHING_ROLE ──switched or failed──> SERVING
    any phase ──SIGTERM, or the engine loop died──> SHUTTING_DOWN (terminal)

(GOING_TO_SLEEP also goes back to SERVING when its drain does not end in time.)
Only SERVING admits calls, and only for the role served now. A refusal names the phase:
UNAVAILABLE while the worker cannot take work for a while (callers retry elsewhere: the router
another worker, a decode worker local prefill), FAILED_PRECONDITION for the other role.

In flight: every admitted call counts from its admission (before it builds its request off
the event loop) until it ends, so `wait_idle` sees all of them. Calls admitted before a phase
change run on to the end; the phase change waits for them (`wait_idle`, bounded).

All of it lives on the worker's asyncio loop; nothing here is touched from the engine thread.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterator
from contextlib import contextmanager

from cluster.roles import ROLES, Role
from worker_runtime.grpc_errors import FailedPrecondition, Unavailable


class WorkerPhase(enum.Enum):
    SERVING = "serving"
    GOING_TO_SLEEP = "going to sleep"
    SLEEPING = "sleeping"
    UPDATING_WEIGHTS = "updating weights"
    SWITCHING_ROLE = "switching roles"
    SHUTTING_DOWN = "draining"

    @property
    def published_draining(self) -> bool:
        """Routers stop placing work here (the registration's `draining` flag)."""
        return self in (WorkerPhase.SWITCHING_ROLE, WorkerPhase.SHUTTING_DOWN)


P = WorkerPhase
_NEXT: dict[WorkerPhase, frozenset[WorkerPhase]] = {
    P.SERVING: frozenset({P.GOING_TO_SLEEP, P.UPDATING_WEIGHTS, P.SWITCHING_ROLE}),
    P.GOING_TO_SLEEP: frozenset({P.SLEEPING, P.SERVING}),
    P.SLEEPING: frozenset({P.SERVING}),
    P.UPDATING_WEIGHTS: frozenset({P.SERVING}),
    P.SWITCHING_ROLE: frozenset({P.SERVING}),
    P.SHUTTING_DOWN: frozenset(),
}


class IllegalPhaseChange(RuntimeError):
    """A phase change `_NEXT` does not allow: a bug in the caller."""


def check_role(role: str) -> Role:
    """The Role named `role`; ValueError naming the choices otherwise."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
    return Role(role)


class Admission:
    """The gate every call passes (`admitted`), the phase behind it and the in-flight count."""

    def __init__(self, role: str) -> None:
        self.role = check_role(role)
        """The role served now (published as `WorkerInfo.role`)."""
        self.switching_to: Role | None = None
        """The role a SWITCHING_ROLE phase moves to; None in every other phase."""
        self._phase = WorkerPhase.SERVING
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.changing = asyncio.Lock()
        """Held through every phase change but shutdown (sleep, wake-up, weight update, role
        switch), so they never interleave."""

    @property
    def phase(self) -> WorkerPhase:
        return self._phase

    @property
    def inflight(self) -> int:
        return self._inflight

    def move(self, to: WorkerPhase, *, switching_to: Role | None = None) -> None:
        """Enter phase `to`. SHUTTING_DOWN is reachable from every phase; leaving it is not."""
        if to is not WorkerPhase.SHUTTING_DOWN and to not in _NEXT[self._phase]:
            raise IllegalPhaseChange(f"{self._phase.name} -> {to.name}")
        if (to is WorkerPhase.SWITCHING_ROLE) != (switching_to is not None):
            raise IllegalPhaseChange("a role switch, and only a role switch, names its role")
        self._phase, self.switching_to = to, switching_to

    def leave(self, phase: WorkerPhase, to: WorkerPhase = WorkerPhase.SERVING) -> None:
        """End `phase` (for `to`) unless shutdown already took over."""
        if self._phase is phase:
            self.move(to)

    def switch_role(self) -> Role:
        """End SWITCHING_ROLE by serving its new role; returns the role served before."""
        if self._phase is not WorkerPhase.SWITCHING_ROLE or self.switching_to is None:
            raise IllegalPhaseChange(f"{self._phase.name}: no role switch to complete")
        previous, self.role = self.role, self.switching_to
        self.move(WorkerPhase.SERVING)
        return previous

    def check(self, role: Role) -> None:
        """Refuse (module docstring) unless a call for `role` would be admitted now."""
        phase = self._phase
        if phase is WorkerPhase.SWITCHING_ROLE:
            raise Unavailable(
                f"worker is switching from the {self.role} role to the {self.switching_to} role"
            )
        if phase is not WorkerPhase.SHUTTING_DOWN and role is not self.role:
            raise FailedPrecondition(
                f"worker serves the {self.role} role, not {role} (Worker.SetRole switches it)"
            )
        if phase is not WorkerPhase.SERVING:
            raise Unavailable(f"worker is {phase.value}")

    @contextmanager
    def admitted(self, role: Role, request_id: str) -> Iterator[None]:
        """Admit one call for `role` (or refuse it) and count it in flight until it ends."""
        self.check(role)
        if not request_id:
            raise ValueError("request_id is required")
        self._inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call is in flight, at most `timeout_s`; True if none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(timeout_s, 0.0))
        except asyncio.TimeoutError:
            pass
        return not self._inflight
