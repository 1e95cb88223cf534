"""The paged engine: a library with no network code.

Public names load lazily, so `import engine.config` (the CLI's flags) does not import torch."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.sampling.sampling_params",
    "RequestOutput": "engine.processing.outputs",
    "CompletionOutput": "engine.processing.outputs",
    "CompletionDelta": "engine.processing.outputs",
    "EmbeddingOutput": "engine.processing.outputs",
    "PoolingParams": "engine.sampling.pooling",
    "LoRARequest": "engine.lora.request",
    "ModelRegistry": "engine.models.registry",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
