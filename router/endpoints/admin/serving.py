"""The fleet-wide admin endpoints (vLLM's dev-mode names; router/endpoints/admin/fleet.py does the
work).

Served only with `--enable-dev-endpoints` or VLLM_SERVER_DEV_MODE=1 (otherwise they do not
exist: 404, as vLLM without dev mode), behind `--admin-api-key`, else `--api-key`, when one is
set (router/http/auth.py):

    POST /sleep?level=1&abort=false   drain (or abort) every worker, then sleep
    POST /wake_up?tags=weights&tags=kv_cache
    GET  /is_sleeping                 {"is_sleeping": any worker sleeps, "workers": {id: bool}}
    POST /reset_prefix_cache
    POST /collective_rpc              {"method", "args", "kwargs", "timeout"} -> {"results"}
    POST /update_weights              {"path"}: a safetensors file or folder every worker reads
    POST /set_role?worker_id=W&role=decode&drain_timeout=S
                                      one worker switches pools (Worker.SetRole; engine kept)
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from cluster.roles import ROLES
from router.endpoints.admin.fleet import FleetAdmin, WorkerResult
from router.endpoints.admin.protocol import (
    CollectiveRPCRequest,
    CollectiveRPCResponse,
    FleetState,
    SetRoleResponse,
    UpdateWeightsRequest,
)
from router.endpoints.base import parse_json
from router.http.errors import bad_request
from router.http.openapi import route_schema

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
ADMIN_PATHS = frozenset(
    {
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/reset_prefix_cache",
        "/collective_rpc",
        "/update_weights",
        "/set_role",
    }
)


def dev_endpoints_enabled(flag: bool) -> bool:
    """`--enable-dev-endpoints` on the router, or vLLM's switch in the environment."""
    return flag or os.environ.get(DEV_MODE_ENV, "") in ("1", "true", "True")


_ERRORS = {
    400: "A malformed query or body, or the workers refused the arguments",
    401: "Missing or wrong API key (`--admin-api-key`, else `--api-key`)",
    403: "An inference key: these need `--admin-api-key` when it is set",
    404: "Dev endpoints not enabled, a weights path a worker cannot find, or a "
    "worker id not registered",
    409: "A worker was not started with `--enable-sleep-mode`, or (set_role) it "
    "sleeps or shuts down",
    500: "Internal error (fixed message; the detail goes to the router's log)",
    502: "Some workers failed; the message names each one with its error",
    503: "No worker is registered (`Retry-After` header)",
}


def _schema(
    request: type[BaseModel] | None, ok: type[BaseModel], query: tuple[dict[str, Any], ...] = ()
) -> dict[str, Any]:
    kw = route_schema(request, ok, errors=(400, 404, 500, 502, 503))
    for status, text in _ERRORS.items():
        kw["responses"].setdefault(status, dict(kw["responses"][400]))["description"] = text
    if query:
        kw.setdefault("openapi_extra", {})["parameters"] = list(query)
    return kw


def _query(name: str, schema: dict[str, Any], text: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": text}


def _state(results: list[WorkerResult]) -> JSONResponse:
    workers = {r.worker_id: r.reply.is_sleeping for r in results}
    return JSONResponse(
        {
            "is_sleeping": any(workers.values()),
            "workers": workers,
            "weights_version": {r.worker_id: r.reply.weights_version for r in results},
        }
    )


def add_admin_routes(app: FastAPI, admin: FleetAdmin) -> None:
    @app.post(
        "/sleep",
        **_schema(
            None,
            FleetState,
            (
                _query(
                    "level",
                    {"type": "integer", "enum": [1, 2], "default": 1},
                    "1: free the KV cache, offload weights; 2: drop weights too",
                ),
                _query(
                    "abort",
                    {"type": "boolean", "default": False},
                    "abort in-flight requests instead of waiting for them",
                ),
            ),
        ),
    )
    async def sleep(request: Request) -> JSONResponse:
        q = request.query_params
        level = q.get("level", "1")
        if level not in ("1", "2"):
            raise bad_request(f"level must be 1 or 2, got {level!r}", "level")
        abort = q.get("abort", "false").lower()
        if abort not in ("true", "false", "1", "0"):
            raise bad_request(f"abort must be true or false, got {abort!r}", "abort")
        return _state(await admin.sleep(int(level), abort in ("true", "1")))

    @app.post(
        "/wake_up",
        **_schema(
            None,
            FleetState,
            (
                _query(
                    "tags",
                    {"type": "array", "items": {"type": "string", "enum": ["weights", "kv_cache"]}},
                    "what to restore (repeatable); default both",
                ),
            ),
        ),
    )
    async def wake_up(request: Request) -> JSONResponse:
        tags = request.query_params.getlist("tags")
        bad = [t for t in tags if t not in ("weights", "kv_cache")]
        if bad:
            raise bad_request(f"tags must be among weights, kv_cache; got {bad}", "tags")
        return _state(await admin.wake_up(tags))

    @app.get("/is_sleeping", **_schema(None, FleetState))
    async def is_sleeping() -> JSONResponse:
        return _state(await admin.is_sleeping())

    @app.post("/reset_prefix_cache", **_schema(None, FleetState))
    async def reset_prefix_cache() -> JSONResponse:
        return _state(await admin.reset_prefix_cache())

    @app.post("/collective_rpc", **_schema(CollectiveRPCRequest, CollectiveRPCResponse))
    async def collective_rpc(request: Request) -> JSONResponse:
        import json

        req = parse_json(CollectiveRPCRequest, await request.body())
        if not req.method:
            raise bad_request("method must not be empty", "method")
        if req.timeout is not None and req.timeout <= 0:
            raise bad_request("timeout must be > 0", "timeout")
        results = await admin.collective_rpc(req.method, req.args, req.kwargs, req.timeout)
        return JSONResponse(
            {
                "results": [x for r in results for x in json.loads(r.reply.results_json)],
                "workers": [r.worker_id for r in results],
            }
        )

    @app.post("/update_weights", **_schema(UpdateWeightsRequest, FleetState))
    async def update_weights(request: Request) -> JSONResponse:
        req = parse_json(UpdateWeightsRequest, await request.body())
        if not req.path:
            raise bad_request("path must not be empty", "path")
        return _state(await admin.update_weights(req.path))

    set_role_schema = _schema(
        None,
        SetRoleResponse,
        (
            _query("worker_id", {"type": "string"}, "the worker to switch (required)"),
            _query("role", {"type": "string", "enum": list(ROLES)}, "its new role (required)"),
            _query(
                "drain_timeout",
                {"type": "number", "minimum": 0, "default": 0},
                "seconds its in-flight requests may take before they are aborted (decode: "
                "migrated); 0 = the worker's --drain-timeout",
            ),
        ),
    )
    set_role_schema["responses"][504] = dict(
        set_role_schema["responses"][400],
        description=("The worker's in-flight calls did not end in time; it keeps its role"),
    )

    @app.post("/set_role", **set_role_schema)
    async def set_role(request: Request) -> JSONResponse:
        q = request.query_params
        worker_id, role = q.get("worker_id", ""), q.get("role", "")
        if not worker_id:
            raise bad_request("worker_id is required", "worker_id")
        if role not in ROLES:
            raise bad_request(f"role must be one of {', '.join(ROLES)}; got {role!r}", "role")
        try:
            drain_timeout = float(q.get("drain_timeout", "0"))
        except ValueError:
            drain_timeout = -1.0
        if not 0 <= drain_timeout < float("inf"):
            raise bad_request(
                f"drain_timeout must be a number >= 0, got {q.get('drain_timeout')!r}",
                "drain_timeout",
            )
        reply = (await admin.set_role(worker_id, role, drain_timeout)).reply
        return JSONResponse(
            {"worker_id": worker_id, "role": reply.role, "previous_role": reply.previous_role}
        )
