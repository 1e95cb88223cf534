"""Elastic roles: one engine that serves the prefill role or the decode role; the role is a
registration in etcd that `Worker.SetRole` moves without restarting the engine.

Every worker has both roles' services on its gRPC server (pdserve/worker_main.py): the KV
transfer agent sends and receives over the one registered pool, and both roles' after-step
and abort hooks stay installed whatever is served, so transfers of the old role still in
flight finish normally after a switch. `WorkerRoles.admit` is the gate: a call for the role
not served now is FAILED_PRECONDITION, a call while switching UNAVAILABLE — the callers'
fallbacks take over (a decode worker prefills locally, the router retries another worker).

Life cycle of a switch (`set_role`; serialized with sleep / wake-up / weight updates by the
lifecycle lock):
1. Same role: nothing happens (idempotent). Unknown role: INVALID_ARGUMENT. Sleeping, going
   to sleep, updating weights or shutting down: FAILED_PRECONDITION, nothing changes.
2. SWITCHING: the gate closes for both roles and `draining` is published at once, so routers
   stop placing work here.
3. Drain: wait until no call is in flight, at most `drain_timeout_s` (0: `--drain-timeout`).
   Then whatever is left is aborted: a decode stream ends with an "abort" update (the router
   migrates it to another decode worker), a prefill call fails UNAVAILABLE (its decode
   worker prefills locally). Calls still in flight `ABORT_GRACE_S` after that fail the
   switch (DEADLINE_EXCEEDED): the worker goes on serving its old role, nothing moved.
   (A call admitted just before the gate closed that had not counted itself in flight yet —
   it was building its request off the event loop — runs on after the switch; the one
   engine serves it to the end like any other.)
4. The role changes; the engine, its KV pool and NIXL registration, its prefix cache, LoRA
   adapters and KV-event stream are untouched (no reload, no reset).
5. The registration moves to the new role's key on the same lease: the new key is put
   before the old one is deleted, so a watcher never sees the worker absent (the router's
   registry keeps the worker, its KV-index entries and its load across the move).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING

from cluster.registration import ROLES
from worker_runtime.grpc_errors import FailedPrecondition, Unavailable
from worker_runtime.lifecycle import abort_all

if TYPE_CHECKING:
    from worker_runtime.runtime import WorkerRuntime

log = logging.getLogger(__name__)

ABORT_GRACE_S = 10.0
"""After the drain timeout aborted what was left: how long those calls may take to end."""


class WorkerRoles:
    """The role this worker serves now, the gate, and switching (asyncio side)."""

    def __init__(self, rt: WorkerRuntime, role: str) -> None:
        _check_role(role)
        self.rt = rt
        self.role = role
        """The role served now (published as `WorkerInfo.role`)."""
        self.switching_to: str | None = None
        """The role being switched to while the old one drains; None otherwise."""

    @property
    def switching(self) -> bool:
        return self.switching_to is not None

    def admit(self, role: str) -> None:
        """Refuse a call for `role` unless this worker serves it now."""
        if self.switching_to is not None:
            raise Unavailable(f"worker is switching from the {self.role} role to the "
                              f"{self.switching_to} role")
        if role != self.role:
            raise FailedPrecondition(f"worker serves the {self.role} role, not {role} "
                                     "(Worker.SetRole switches it)")

    async def set_role(self, role: str, drain_timeout_s: float = 0.0) -> str:
        """Serve `role` from now on (module docstring); returns the role served before."""
        _check_role(role)
        if not math.isfinite(drain_timeout_s) or drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {drain_timeout_s}")
        rt = self.rt
        async with rt.lifecycle.lock:
            previous = self.role
            if role == previous:
                return previous
            self._check_switchable()
            self.switching_to = role
            try:
                await rt.republish()  # draining: routers stop placing work here
                await self._drain(drain_timeout_s or rt.config.drain_timeout_s)
            except BaseException:
                self.switching_to = None
                await rt.republish()
                raise
            self.role, self.switching_to = role, None
            rt.metrics.set_role(role, previous)
            log.info("switched from the %s role to the %s role (engine and prefix cache kept)",
                     previous, role)
            if rt.registrar is not None:
                await rt.registrar.move(previous)
        return previous

    def _check_switchable(self) -> None:
        rt = self.rt
        if rt.draining:
            raise FailedPrecondition("worker is shutting down")
        if rt.lifecycle.sleeping:
            raise FailedPrecondition("worker is sleeping: wake it up before switching roles")
        if rt.paused is not None:
            raise FailedPrecondition(f"worker is {rt.paused}")

    async def _drain(self, timeout_s: float) -> None:
        rt = self.rt
        deadline = time.monotonic() + timeout_s
        while rt.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if not rt.inflight:
            return
        log.warning("role switch: %d calls still in flight after %g s; aborting them",
                    rt.inflight, timeout_s)
        await abort_all(rt)
        deadline = time.monotonic() + ABORT_GRACE_S
        while rt.inflight:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"role switch: {rt.inflight} calls still in flight "
                                   f"{ABORT_GRACE_S:g} s after aborting them; still "
                                   f"serving the {self.role} role")
            await asyncio.sleep(0.02)


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
