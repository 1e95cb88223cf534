"""Which adapter a request runs with (vLLM's `LoRARequest`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    """The name clients use (the served model name in the OpenAI API)."""
    lora_int_id: int
    """A positive id, unique per adapter: enters every block hash of the request's KV, so
    requests share cached blocks only with the same adapter."""
    lora_path: str = ""
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")


def lora_id_for(name: str) -> int:
    """A stable positive id from an adapter's name: every process of a cluster (router and
    workers) derives the same one, so block hashes agree without coordination."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "little") + 1
