"""The fleet-wide weights lifecycle: one admin call -> the same `Worker` RPC on every
registered worker of both pools, concurrently; the call answers once all of them applied it,
or names the workers that failed. One per-worker call besides: `set_role` moves one worker
between the prefill and decode pools (`Worker.SetRole`; its engine keeps running).

The gate: while the fleet sleeps (or takes new weights), generation requests wait for it to
wake up, at most `--queue-timeout`, then get 503 with `Retry-After`. The fleet sleeps when
this router put it to sleep and no wake-up brought every worker back, or when every
registered decode worker publishes `sleeping` (another router, or a restart of this one).
Workers refuse requests on their own while asleep (UNAVAILABLE), and placement never picks a
sleeping worker, so nothing depends on the gate for safety; it only turns refusals into waits.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import grpc

from cluster.registration import WorkerInfo
from cluster.roles import Role
from proto import pdserve_pb2 as pb
from router.channels import ChannelPool
from router.http.errors import APIError
from router.placement.registry import WorkerRegistry

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 300.0
"""Per-worker bound of an admin RPC (a sleep drains first; a weight update reads a file)."""
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
}


@dataclass(frozen=True, slots=True)
class WorkerResult:
    """One worker's answer to a fan-out: `reply` (the RPC's response) or `error`."""

    worker_id: str
    reply: Any = None
    error: grpc.aio.AioRpcError | None = None


class FleetAdmin:
    def __init__(self, registry: WorkerRegistry, channels: ChannelPool, wait_s: float) -> None:
        self.registry = registry
        self.channels = channels
        self.wait_s = wait_s
        self._closed: str | None = None  # why this router holds requests ("sleeping", ...)
        self._lock = asyncio.Lock()  # one admin call at a time

    # ---- the gate ---------------------------------------------------------------------------
    def asleep(self) -> str | None:
        """Why generation requests must wait now, None when they need not."""
        if self._closed is not None:
            return self._closed
        decode = self.registry.by_role(Role.DECODE)
        return "sleeping" if decode and all(s.info.sleeping for s in decode) else None

    async def wait_awake(self) -> None:
        """Return when the fleet serves; APIError 503 (Retry-After) after `wait_s`."""
        if self.asleep() is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while (why := self.asleep()) is not None:
            left = deadline - loop.time()
            if left <= 0:
                raise APIError(
                    503,
                    f"The fleet is {why}: no worker serves until it wakes up "
                    "(POST /wake_up); try again later.",
                    code="overloaded",
                    headers={"Retry-After": "5"},
                )
            await self.registry.wait_changed(min(left, 0.1))

    # ---- the calls ------------------------------------------------------------------------------
    async def sleep(self, level: int, abort: bool) -> list[WorkerResult]:
        async with self._lock:
            self._closed = "sleeping"  # new requests wait from now on
            results = await self._fan_out("Sleep", pb.SleepRequest(level=level, abort=abort))
            self._closed = (
                "sleeping"
                if any(r.reply is not None and r.reply.is_sleeping for r in results)
                else None
            )
        return _checked("sleep", results)

    async def wake_up(self, tags: list[str]) -> list[WorkerResult]:
        async with self._lock:
            results = await self._fan_out("WakeUp", pb.WakeUpRequest(tags=tags))
            if all(r.reply is not None and not r.reply.is_sleeping for r in results):
                self._closed = None
                await self._until(lambda info: not info.sleeping)
        return _checked("wake_up", results)

    async def is_sleeping(self) -> list[WorkerResult]:
        return _checked("is_sleeping", await self._fan_out("IsSleeping", pb.LifecycleRequest()))

    async def reset_prefix_cache(self) -> list[WorkerResult]:
        async with self._lock:
            results = await self._fan_out("ResetPrefixCache", pb.LifecycleRequest())
        return _checked("reset_prefix_cache", results)

    async def collective_rpc(
        self, method: str, args: list, kwargs: dict, timeout_s: float | None
    ) -> list[WorkerResult]:
        request = pb.CollectiveRPCRequest(
            method=method, args_json=json.dumps(args), kwargs_json=json.dumps(kwargs)
        )
        async with self._lock:
            results = await self._fan_out("CollectiveRPC", request, timeout_s)
        return _checked("collective_rpc", results)

    async def update_weights(self, path: str) -> list[WorkerResult]:
        async with self._lock:
            before, self._closed = self._closed, "updating its weights"
            try:
                results = await self._fan_out("UpdateWeights", pb.UpdateWeightsRequest(path=path))
                versions = {r.worker_id: r.reply.weights_version for r in results if r.reply}
                await self._until(
                    lambda info: (
                        versions.get(info.worker_id, info.weights_version) == info.weights_version
                    )
                )
            finally:
                self._closed = before
        return _checked("update_weights", results)

    async def set_role(self, worker_id: str, role: str, drain_timeout_s: float) -> WorkerResult:
        """`Worker.SetRole` on one registered worker; answers once this router's registry
        shows it in `role` (the worker moved its registration before answering). APIError
        404 for a worker not registered here, 504 when its in-flight calls did not end in
        time (it keeps its role), else as `_checked`."""
        state = self.registry.get(worker_id)
        if state is None:
            raise APIError(
                404,
                f"No worker {worker_id!r} is registered here (GET /dashboard/data lists them).",
                param="worker_id",
                code="worker_not_found",
            )
        request = pb.SetRoleRequest(role=role, drain_timeout_s=drain_timeout_s)
        # The worker may drain for drain_timeout_s (0: its own --drain-timeout) before it
        # answers; RPC_TIMEOUT_S bounds the default case.
        timeout_s = max(RPC_TIMEOUT_S, 2 * drain_timeout_s + 60.0)
        async with self._lock:
            result = await self._call(state.info, "SetRole", request, timeout_s)
            if result.reply is not None:
                await self._until(lambda info: info.worker_id != worker_id or info.role == role)
        if result.error is not None and result.error.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            raise APIError(
                504, f"set_role on {worker_id}: {result.error.details()}", code="worker_failed"
            )
        return _checked("set_role", [result])[0]

    # ---- fan-out ----
    def _workers(self) -> list[WorkerInfo]:
        workers = [s.info for s in self.registry.all() if not s.info.draining]
        if not workers:
            raise APIError(
                503,
                "No worker is registered; try again when workers are up.",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        return sorted(workers, key=lambda w: (w.role != Role.PREFILL, w.worker_id))

    async def _fan_out(
        self, method: str, request, timeout_s: float | None = None
    ) -> list[WorkerResult]:
        workers = self._workers()
        return list(
            await asyncio.gather(*(self._call(w, method, request, timeout_s) for w in workers))
        )

    async def _call(
        self, info: WorkerInfo, method: str, request, timeout_s: float | None
    ) -> WorkerResult:
        rpc = getattr(self.channels.worker(info.grpc_address), method)
        try:
            return WorkerResult(
                info.worker_id, await rpc(request, timeout=timeout_s or RPC_TIMEOUT_S)
            )
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "%s on %s failed: %s: %s", method, info.worker_id, exc.code().name, exc.details()
            )
            return WorkerResult(info.worker_id, error=exc)

    async def _until(self, agrees, timeout_s: float = 2.0) -> None:
        """Wait (briefly) until every registration agrees: the workers republish before they
        answer, so the registry is only an etcd round trip behind."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not all(agrees(s.info) for s in self.registry.all()) and loop.time() < deadline:
            await self.registry.wait_changed(max(0.0, deadline - loop.time()))


def _checked(call: str, results: list[WorkerResult]) -> list[WorkerResult]:
    """`results` when every worker applied the call; else an APIError naming the failed ones:
    the workers' own 4xx when they all refused alike (400 bad argument, 404 missing path,
    403 admin RPCs not enabled, 409 sleep mode not enabled), else 502."""
    failed = [(r.worker_id, r.error) for r in results if r.error is not None]
    if not failed:
        return results
    statuses = {_STATUS.get(error.code(), 502) for _, error in failed}
    status = statuses.pop() if len(statuses) == 1 else 502
    names = "; ".join(
        f"{worker}: {error.code().name}: {error.details()}" for worker, error in failed
    )
    raise APIError(
        status,
        f"{call} failed on {len(failed)} of {len(results)} workers ({names})",
        code="worker_failed",
    )
