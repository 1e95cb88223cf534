"""The fleet admin's pieces without workers: the routes declare their schemas (when enabled),
the gate holds generation requests while the fleet sleeps and answers 503 with Retry-After
after the bound, and a partial failure names the workers that failed."""

import asyncio

import grpc
import pytest
from fastapi import FastAPI

from cluster.grpc_security import OPEN
from cluster.registration import WorkerInfo
from router.channels import ChannelPool
from router.endpoints.admin.fleet import FleetAdmin, WorkerResult, _checked
from router.endpoints.admin.serving import ADMIN_PATHS, add_admin_routes, dev_endpoints_enabled
from router.http.errors import APIError
from router.http.openapi import install_openapi
from router.placement.registry import WorkerRegistry


def info(wid, role="decode", sleeping=False):
    return WorkerInfo(
        worker_id=wid,
        role=role,
        grpc_address=f"{wid}:1",
        model_id="m",
        compat_hash="c",
        block_size=16,
        sleeping=sleeping,
    )


def test_routes_declare_their_schemas():
    app = FastAPI()
    add_admin_routes(app, FleetAdmin(WorkerRegistry(), ChannelPool(OPEN), 0.1))
    install_openapi(app)
    paths = app.openapi()["paths"]
    assert set(paths) == ADMIN_PATHS
    for ops in paths.values():
        for op in ops.values():
            assert {"200", "400", "401", "404", "409", "502", "503"} <= set(op["responses"])
    assert [p["name"] for p in paths["/sleep"]["post"]["parameters"]] == ["level", "abort"]


def test_enabled_by_flag_or_vllm_env(monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    assert not dev_endpoints_enabled(False) and dev_endpoints_enabled(True)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert dev_endpoints_enabled(False)


def test_the_gate_waits_then_503s_while_every_decode_worker_sleeps():
    async def main():
        registry = WorkerRegistry()
        admin = FleetAdmin(registry, ChannelPool(OPEN), wait_s=0.3)
        registry.put(info("d1", sleeping=True))
        registry.put(info("p", "prefill"))
        with pytest.raises(APIError) as exc:
            await admin.wait_awake()
        assert exc.value.status == 503 and exc.value.headers["Retry-After"]
        waiter = asyncio.create_task(admin.wait_awake())
        await asyncio.sleep(0.05)
        registry.put(info("d1"))  # woke up (another router, or a restart of this one)
        await asyncio.wait_for(waiter, 1)

    asyncio.run(main())


class _Err(grpc.aio.AioRpcError):
    def __init__(self, code, details):
        super().__init__(code, None, None, details)


def test_partial_failure_names_the_failed_workers():
    ok = WorkerResult("p", reply=object())
    bad = WorkerResult("d2", error=_Err(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    with pytest.raises(APIError) as exc:
        _checked("sleep", [ok, bad])
    assert exc.value.status == 502
    assert (
        exc.value.message == "sleep failed on 1 of 2 workers (d2: UNAVAILABLE: connection refused)"
    )
    refused = WorkerResult("d1", error=_Err(grpc.StatusCode.FAILED_PRECONDITION, "no sleep mode"))
    with pytest.raises(APIError) as exc:
        _checked("sleep", [ok, refused])
    assert exc.value.status == 409
    denied = WorkerResult(
        "d1", error=_Err(grpc.StatusCode.PERMISSION_DENIED, "start it with --enable-admin-rpcs")
    )
    with pytest.raises(APIError) as exc:
        _checked("sleep", [ok, denied])
    assert exc.value.status == 403 and "--enable-admin-rpcs" in exc.value.message
    assert _checked("sleep", [ok]) == [ok]


def test_set_role_refuses_bad_input_in_openai_shape():
    from fastapi.testclient import TestClient

    app = FastAPI()
    app.add_exception_handler(APIError, lambda request, exc: exc.response())
    registry = WorkerRegistry()
    add_admin_routes(app, FleetAdmin(registry, ChannelPool(OPEN), 0.1))
    client = TestClient(app)
    for query, param in [
        ({"role": "decode"}, "worker_id"),
        ({"worker_id": "w", "role": "both"}, "role"),
        ({"worker_id": "w", "role": "decode", "drain_timeout": "-1"}, "drain_timeout"),
        ({"worker_id": "w", "role": "decode", "drain_timeout": "soon"}, "drain_timeout"),
    ]:
        r = client.post("/set_role", params=query)
        assert r.status_code == 400, query
        assert (
            r.json()["error"]["param"] == param
            and r.json()["error"]["type"] == "invalid_request_error"
        )
    r = client.post("/set_role", params={"worker_id": "w", "role": "decode"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "worker_not_found"
    assert "'w'" in r.json()["error"]["message"]


def test_set_role_maps_the_workers_answers():
    """The reply once the registry shows the new role; the worker's refusals as 409 / 504."""
    from proto import pdserve_pb2 as pb

    async def main():
        registry = WorkerRegistry()
        registry.put(info("w", role="prefill"))
        answers = []

        async def set_role(request, timeout=None):
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            registry.put(info("w", role=request.role))  # the worker republished before answering
            return answer

        channels = type(
            "Channels",
            (),
            {
                "worker": lambda self, address: type(
                    "Stub", (), {"SetRole": staticmethod(set_role)}
                )()
            },
        )()
        admin = FleetAdmin(registry, channels, 0.1)
        answers.append(pb.SetRoleResponse(role="decode", previous_role="prefill"))
        result = await admin.set_role("w", "decode", 0.0)
        assert result.reply.previous_role == "prefill" and registry.get("w").info.role == "decode"
        for code, status in [
            (grpc.StatusCode.FAILED_PRECONDITION, 409),
            (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
            (grpc.StatusCode.UNAVAILABLE, 502),
        ]:
            answers.append(_Err(code, "no"))
            with pytest.raises(APIError) as exc:
                await admin.set_role("w", "prefill", 1.0)
            assert exc.value.status == status and "no" in exc.value.message
        assert registry.get("w").info.role == "decode"

    asyncio.run(main())
