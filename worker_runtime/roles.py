"""Elastic roles: one engine that serves the prefill role or the decode role; the role is a
registration in etcd that `Worker.SetRole` moves without restarting the engine.

Every worker has both roles' services on its gRPC server (pdserve/worker_main.py): the KV
transfer agent sends and receives over the one registered pool, and both roles' after-step
and abort hooks stay installed whatever is served, so transfers of the old role still in
flight finish normally after a switch. The gate is `Admission` (admission.py): a call for the
role not served now is FAILED_PRECONDITION, a call while switching UNAVAILABLE — the callers'
fallbacks take over (a decode worker prefills locally, the router retries another worker).

Life cycle of a switch (`set_role`; serialized with sleep / wake-up / weight updates by
`Admission.changing`):
1. Same role: nothing happens (idempotent). Unknown role: INVALID_ARGUMENT. Sleeping, going
   to sleep, updating weights or shutting down: FAILED_PRECONDITION, nothing changes.
2. SWITCHING_ROLE: the gate closes for both roles and `draining` is published at once, so
   routers stop placing work here.
3. Drain: wait until no call is in flight (counted from admission, request building
   included), at most `drain_timeout_s` (0: `--drain-timeout`). Then whatever is left is
   aborted: a decode stream ends with an "abort" update (the router migrates it to another
   decode worker), a prefill call fails UNAVAILABLE (its decode worker prefills locally).
   Calls still in flight `ABORT_GRACE_S` after that fail the switch (DEADLINE_EXCEEDED): the
   worker goes on serving its old role, nothing moved.
4. The role changes; the engine, its KV pool and NIXL registration, its prefix cache, LoRA
   adapters and KV-event stream are untouched (no reload, no reset).
5. The registration moves to the new role's key on the same lease: the new key is put
   before the old one is deleted, so a watcher never sees the worker absent (the router's
   registry keeps the worker, its KV-index entries and its load across the move).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

from cluster.roles import Role
from worker_runtime.admission import Admission, WorkerPhase, check_role
from worker_runtime.grpc_errors import FailedPrecondition

log = logging.getLogger(__name__)

ABORT_GRACE_S = 10.0
"""After the drain timeout aborted what was left: how long those calls may take to end."""


class WorkerRoles:
    """Switching the role served (asyncio side); the role itself is `Admission.role`."""

    def __init__(
        self,
        admission: Admission,
        publish: Callable[[], Awaitable[None]],
        move_registration: Callable[[str], Awaitable[None]],
        abort_all: Callable[[], Awaitable[None]],
        on_switched: Callable[[Role, Role], None],
        *,
        drain_timeout_s: float,
    ) -> None:
        self._admission = admission
        self._publish = publish
        self._move_registration = move_registration
        """Registrar.move(old_role): the registration follows `admission.role`."""
        self._abort_all = abort_all
        self._on_switched = on_switched
        """(new role, previous role), once switched (the role gauge in /metrics)."""
        self._drain_timeout_s = drain_timeout_s

    async def set_role(self, role: str, drain_timeout_s: float = 0.0) -> Role:
        """Serve `role` from now on (module docstring); returns the role served before."""
        new = check_role(role)
        if not math.isfinite(drain_timeout_s) or drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {drain_timeout_s}")
        admission = self._admission
        async with admission.changing:
            previous = admission.role
            if new is previous:
                return previous
            _check_switchable(admission.phase)
            admission.move(WorkerPhase.SWITCHING_ROLE, switching_to=new)
            try:
                await self._publish()  # draining: routers stop placing work here
                await self._drain(drain_timeout_s or self._drain_timeout_s)
            except BaseException:
                admission.leave(WorkerPhase.SWITCHING_ROLE)
                await self._publish()
                raise
            admission.switch_role()
            self._on_switched(new, previous)
            log.info(
                "switched from the %s role to the %s role (engine and prefix cache kept)",
                previous,
                new,
            )
            await self._move_registration(previous)
        return previous

    async def _drain(self, timeout_s: float) -> None:
        admission = self._admission
        if await admission.wait_idle(timeout_s):
            return
        log.warning(
            "role switch: %d calls still in flight after %g s; aborting them",
            admission.inflight,
            timeout_s,
        )
        await self._abort_all()
        if not await admission.wait_idle(ABORT_GRACE_S):
            raise TimeoutError(
                f"role switch: {admission.inflight} calls still in flight "
                f"{ABORT_GRACE_S:g} s after aborting them; still serving the "
                f"{admission.role} role"
            )


def _check_switchable(phase: WorkerPhase) -> None:
    if phase is WorkerPhase.SHUTTING_DOWN:
        raise FailedPrecondition("worker is shutting down")
    if phase is WorkerPhase.SLEEPING:
        raise FailedPrecondition("worker is sleeping: wake it up before switching roles")
    if phase is not WorkerPhase.SERVING:
        raise FailedPrecondition(f"worker is {phase.value}")
