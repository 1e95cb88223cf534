"""POST /v1/embeddings: the request body and the response bodies."""

from __future__ import annotations

from typing import Literal, Union

from router.endpoints.base import RequestModel, ResponseModel


class EmbeddingRequest(RequestModel):
    """OpenAI's body; vLLM's extensions (`truncate_prompt_tokens`, `add_special_tokens`,
    `normalize`, `priority`, `request_id`, `cache_salt`); pdserve's `pooling_type`. Other
    fields: the one policy (router/endpoints/base.py)."""

    input: Union[str, list[int], list[str], list[list[int]]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = None
    pooling_type: Literal["last", "mean"] = "last"


class Embedding(ResponseModel):
    object: Literal["embedding"]
    index: int
    embedding: Union[list[float], str]  # floats, or base64 of little-endian float32


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
