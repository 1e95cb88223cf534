"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM): the request bodies (both
answer a plain-text "Success")."""

from __future__ import annotations

from router.endpoints.base import RequestModel


class LoadLoRAAdapterRequest(RequestModel):
    """POST /v1/load_lora_adapter (vLLM)."""

    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(RequestModel):
    """POST /v1/unload_lora_adapter (vLLM): the name, or the adapter's id (lora_id_for(name))."""

    lora_name: str | None = None
    lora_int_id: int | None = None
