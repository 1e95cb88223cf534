"""GET /v1/models, /v1/models/{id}, /version and /health: the response bodies."""

from __future__ import annotations

from typing import Literal

from router.endpoints.base import ResponseModel


class ModelInfo(ResponseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    parent: str | None = None  # a LoRA adapter: the base model's id


class ModelList(ResponseModel):
    object: Literal["list"]
    data: list[ModelInfo]


class VersionResponse(ResponseModel):
    version: str


class HealthResponse(ResponseModel):
    """200 when a decode worker is usable, else 503 (`no_decode_workers`)."""

    status: Literal["ok", "no_decode_workers"]
    decode_workers: int
    prefill_workers: int
