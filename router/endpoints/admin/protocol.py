"""The fleet-wide admin endpoints (router/endpoints/admin/serving.py): request and response
bodies."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from router.endpoints.base import RequestModel, ResponseModel


class CollectiveRPCRequest(RequestModel):
    """POST /collective_rpc (vLLM)."""

    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None
    """Seconds each worker may take (default: the router's admin bound)."""


class UpdateWeightsRequest(RequestModel):
    """POST /update_weights: a safetensors file or directory every worker can read."""

    path: str


class FleetState(ResponseModel):
    """Each worker's state after the call."""

    is_sleeping: bool
    """Whether any worker sleeps."""
    workers: dict[str, bool]
    """worker id -> sleeping."""
    weights_version: dict[str, int]
    """worker id -> its weights version (bumped by every weight update)."""


class CollectiveRPCResponse(ResponseModel):
    results: list[Any]
    """One result per worker, in the order of `workers` (prefill workers first)."""
    workers: list[str]


class SetRoleResponse(ResponseModel):
    """POST /set_role: the worker's role before and after (equal: it served it already)."""

    worker_id: str
    role: str
    previous_role: str
