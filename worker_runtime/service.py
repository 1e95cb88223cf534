"""The `Worker` gRPC service every worker answers, whatever role it serves: health and
capacity, aborts, KV events, blocks a peer pulls (kv_export.py), LoRA adapters, the weights
lifecycle and role switching. Thin: the work is in WorkerRuntime (runtime.py),
WorkerLifecycle (lifecycle.py) and WorkerRoles (roles.py), which it sees through
`ServiceContext`; exceptions become status codes in one place
(grpc_errors.StatusInterceptor)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from worker_runtime.grpc_errors import PermissionDenied
from worker_runtime.kv_export import KVExporter

if TYPE_CHECKING:
    from cluster.registration import WorkerInfo
    from cluster.roles import Role
    from worker_runtime.adapters import ServedAdapters
    from worker_runtime.lifecycle import WorkerLifecycle
    from worker_runtime.roles import WorkerRoles


@dataclass(frozen=True, slots=True)
class ServiceContext:
    """What the `Worker` calls answer from (built by wiring.py)."""

    info: Callable[[], WorkerInfo]
    """The registration as published now (Health)."""
    abort: Callable[[str], Awaitable[bool]]
    """Abort a request in any state; False if it was not known (the rooms' abort hooks)."""
    kv_events: Callable[[], AsyncIterator[pb.KVEventBatch]]
    """One subscription to the KV events of every engine step."""
    cached_blocks: Callable[[], Awaitable[pb.CachedBlocksResponse]]
    adapters: ServedAdapters
    lifecycle: WorkerLifecycle
    roles: WorkerRoles
    role: Callable[[], Role]
    """The role served now."""
    enable_admin_rpcs: bool


class WorkerService(pb_grpc.WorkerServicer):
    """Calls every worker answers (thin: all work is behind `ServiceContext`)."""

    def __init__(self, ctx: ServiceContext, exporter: KVExporter) -> None:
        self.ctx = ctx
        self.adapters, self.lifecycle, self.roles = ctx.adapters, ctx.lifecycle, ctx.roles
        self.exporter = exporter
        self._admin = ctx.enable_admin_rpcs

    def _require_admin(self, rpc: str) -> None:
        """Admin RPCs change the worker's weights, memory, adapters or role: only served
        when the worker was started with --enable-admin-rpcs."""
        if not self._admin:
            raise PermissionDenied(
                f"{rpc} is an admin RPC: start the worker with --enable-admin-rpcs to serve it"
            )

    async def Health(self, request, context):
        info = self.ctx.info()
        c = info.capacity
        return pb.HealthResponse(
            role=info.role,
            worker_id=info.worker_id,
            model_id=info.model_id,
            draining=info.draining,
            capacity=pb.Capacity(**asdict(c)),
        )

    async def Abort(self, request, context):
        if not request.request_id:
            raise ValueError("request_id is required")
        return pb.AbortResponse(found=await self.ctx.abort(request.request_id))

    async def SubscribeKVEvents(self, request, context):
        await context.send_initial_metadata(())  # the subscriber knows it is subscribed
        async for batch in self.ctx.kv_events():
            yield batch

    async def GetCachedBlocks(self, request, context):
        return await self.ctx.cached_blocks()

    async def SendBlocks(self, request, context):
        return await self.exporter.send_blocks(request)

    async def LoadLoRAAdapter(self, request, context):
        self._require_admin("LoadLoRAAdapter")
        adapter = request.adapter
        if not adapter.name:
            raise ValueError("lora_name must not be empty")
        await self.adapters.load(adapter.name, adapter.path)
        return pb.LoRAResponse(found=True, served=self.adapters.to_pb())

    async def UnloadLoRAAdapter(self, request, context):
        self._require_admin("UnloadLoRAAdapter")
        if not request.name:
            raise ValueError("lora_name must not be empty")
        found = await self.adapters.unload(request.name)
        return pb.LoRAResponse(found=found, served=self.adapters.to_pb())

    # ---- weights lifecycle (lifecycle.py) ---------------------------------------------------
    async def Sleep(self, request, context):
        self._require_admin("Sleep")
        await self.lifecycle.sleep(request.level or 1, request.abort)
        return self._state()

    async def WakeUp(self, request, context):
        self._require_admin("WakeUp")
        await self.lifecycle.wake_up(list(request.tags))
        return self._state()

    async def IsSleeping(self, request, context):
        return self._state()

    async def ResetPrefixCache(self, request, context):
        self._require_admin("ResetPrefixCache")
        await self.lifecycle.reset_prefix_cache()
        return self._state()

    async def CollectiveRPC(self, request, context):
        self._require_admin("CollectiveRPC")
        if not request.method:
            raise ValueError("method is required")
        return pb.CollectiveRPCResponse(
            results_json=await self.lifecycle.collective_rpc(
                request.method, request.args_json, request.kwargs_json
            )
        )

    async def UpdateWeights(self, request, context):
        self._require_admin("UpdateWeights")
        await self.lifecycle.update_weights(request.path)
        return self._state()

    async def SetRole(self, request, context):
        self._require_admin("SetRole")
        previous = await self.roles.set_role(request.role, request.drain_timeout_s)
        return pb.SetRoleResponse(role=self.ctx.role().value, previous_role=previous.value)

    def _state(self) -> pb.LifecycleResponse:
        life = self.lifecycle
        return pb.LifecycleResponse(is_sleeping=life.sleeping, weights_version=life.weights_version)
