"""Admin RPCs are refused (PERMISSION_DENIED) unless the worker was started with
--enable-admin-rpcs; the read-only ones are not gated (a real grpc.aio server on loopback,
the real WorkerService and interceptor, a recording runtime)."""

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from worker_runtime.grpc_errors import StatusInterceptor
from worker_runtime.service import ServiceContext, WorkerService

pytestmark = pytest.mark.timeout(30)

ADMIN = {
    "Sleep": pb.SleepRequest(level=1),
    "WakeUp": pb.WakeUpRequest(),
    "ResetPrefixCache": pb.LifecycleRequest(),
    "UpdateWeights": pb.UpdateWeightsRequest(path="/etc/passwd"),
    "CollectiveRPC": pb.CollectiveRPCRequest(method="sleep"),
    "LoadLoRAAdapter": pb.LoadLoRARequest(adapter=pb.LoRAAdapter(name="a", path="/")),
    "UnloadLoRAAdapter": pb.UnloadLoRARequest(name="a"),
    "SetRole": pb.SetRoleRequest(role="prefill"),
}


class RecordingRuntime:
    """Records every call that got past the gate."""

    def __init__(self, enable_admin_rpcs: bool) -> None:
        self.config = SimpleNamespace(enable_admin_rpcs=enable_admin_rpcs)
        self.reached: list[str] = []
        record = self._record
        self.lifecycle = SimpleNamespace(
            sleeping=False,
            weights_version=0,
            sleep=record("Sleep"),
            wake_up=record("WakeUp"),
            reset_prefix_cache=record("ResetPrefixCache"),
            update_weights=record("UpdateWeights"),
            collective_rpc=record("CollectiveRPC", "[]"),
        )
        self.roles = SimpleNamespace(set_role=record("SetRole"))
        self.adapters = SimpleNamespace(
            load=record("LoadLoRAAdapter"), unload=record("UnloadLoRAAdapter", True), to_pb=list
        )

    def _record(self, name, result=None):
        async def call(*args):
            self.reached.append(name)
            if name == "SetRole":
                raise ValueError("recorded")  # no admission here: end the call
            return result

        return call

    def served_loras(self):
        return []


async def _call_all(enable: bool) -> tuple[dict[str, grpc.StatusCode], list[str]]:
    rt = RecordingRuntime(enable)
    server = grpc.aio.server(interceptors=[StatusInterceptor()])
    ctx = ServiceContext(
        info=None,
        abort=None,
        kv_events=None,
        cached_blocks=None,
        adapters=rt.adapters,
        lifecycle=rt.lifecycle,
        roles=rt.roles,
        role=None,
        enable_admin_rpcs=rt.config.enable_admin_rpcs,
    )
    pb_grpc.add_WorkerServicer_to_server(WorkerService(ctx, exporter=None), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    codes = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.WorkerStub(ch)
            for name, request in ADMIN.items():
                try:
                    await getattr(stub, name)(request, timeout=5)
                    codes[name] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    codes[name] = exc.code()
                    if exc.code() is grpc.StatusCode.PERMISSION_DENIED:
                        assert "--enable-admin-rpcs" in exc.details()
            await stub.IsSleeping(pb.LifecycleRequest(), timeout=5)  # read-only: never gated
    finally:
        await server.stop(0)
    return codes, rt.reached


def test_admin_rpcs_are_refused_unless_enabled():
    codes, reached = asyncio.run(_call_all(enable=False))
    assert codes == {name: grpc.StatusCode.PERMISSION_DENIED for name in ADMIN}
    assert reached == []


def test_enabled_admin_rpcs_reach_the_worker():
    codes, reached = asyncio.run(_call_all(enable=True))
    assert reached == list(ADMIN)
    assert all(code is not grpc.StatusCode.PERMISSION_DENIED for code in codes.values())
