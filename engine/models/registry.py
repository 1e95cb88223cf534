"""Model registry: architecture name (config.json `architectures[0]`) -> model class.

Built in: `LlamaForCausalLM` (engine/models/llama.py), `Qwen2ForCausalLM` and
`Qwen3ForCausalLM`, `Qwen3MoeForCausalLM` (engine/models/qwen.py), `MistralForCausalLM`
and `MixtralForCausalLM` (mistral.py), `Gemma2ForCausalLM` and `Gemma3ForCausalLM`
(gemma.py), `Phi3ForCausalLM` (phi3.py), `GraniteForCausalLM` (granite.py),
`Olmo2ForCausalLM` (olmo2.py). Out-of-tree architectures register with
`ModelRegistry.register_model("MyForCausalLM", MyModel)` or a lazily imported
`"my_pkg.model:MyModel"`. So that every process (the offline engine, each prefill and decode
worker) knows them without code changes, plugins are discovered on first use: every entry
point in the group `pdserve.model_plugins` is loaded and called with no arguments — vLLM's
`vllm.general_plugins` pattern:

    [project.entry-points."pdserve.model_plugins"]
    my_arch = "my_pkg:register"      # def register(): ModelRegistry.register_model(...)

The table is process-wide state by nature (like vLLM's); registering twice the same name
replaces the entry.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from engine.models.interface import CausalLM

log = logging.getLogger(__name__)

PLUGIN_GROUP = "pdserve.model_plugins"


class UnknownArchitectureError(ValueError):
    """config.json names an architecture nothing registered."""


class ModelRegistry:
    """Class-level registry (use the class, not instances)."""

    BUILTIN: dict[str, type | str] = {
        "LlamaForCausalLM": "engine.models.llama:Transformer",
        "Qwen2ForCausalLM": "engine.models.qwen:Qwen2ForCausalLM",
        "Qwen3ForCausalLM": "engine.models.qwen:Qwen3ForCausalLM",
        "MistralForCausalLM": "engine.models.mistral:MistralForCausalLM",
        "Gemma2ForCausalLM": "engine.models.gemma:Gemma2ForCausalLM",
        "Gemma3ForCausalLM": "engine.models.gemma:Gemma3ForCausalLM",
        "Phi3ForCausalLM": "engine.models.phi3:Phi3ForCausalLM",
        "MixtralForCausalLM": "engine.models.mistral:MixtralForCausalLM",
        "Qwen3MoeForCausalLM": "engine.models.qwen:Qwen3MoeForCausalLM",
        "GraniteForCausalLM": "engine.models.granite:GraniteForCausalLM",
        "Olmo2ForCausalLM": "engine.models.olmo2:Olmo2ForCausalLM",
    }
    _models: dict[str, type | str] = dict(BUILTIN)
    _plugins_loaded = False
    _failed_plugins: dict[str, str] = {}  # entry point name -> error, for the unknown-arch error
    _lock = threading.RLock()

    @classmethod
    def register_model(cls, arch: str, model_cls: type | str) -> None:
        """`model_cls`: the class, or "module:Class" imported on first `resolve`."""
        if isinstance(model_cls, str) and ":" not in model_cls:
            raise ValueError(f"{model_cls!r}: expected a class or 'module:Class'")
        if not isinstance(model_cls, (str, type)):
            raise TypeError(f"{model_cls!r}: expected a class or 'module:Class'")
        with cls._lock:
            cls._models[arch] = model_cls

    @classmethod
    def get_supported_archs(cls) -> list[str]:
        cls.load_plugins()
        return sorted(cls._models)

    @classmethod
    def is_supported(cls, arch: str) -> bool:
        cls.load_plugins()
        return arch in cls._models

    @classmethod
    def resolve(cls, arch: str) -> type[CausalLM]:
        """The model class for `arch`; UnknownArchitectureError lists what is supported."""
        cls.load_plugins()
        with cls._lock:
            entry = cls._models.get(arch)
            if entry is None:
                failed = "".join(
                    f"; plugin {n!r} failed to load: {e}"
                    for n, e in sorted(cls._failed_plugins.items())
                )
                raise UnknownArchitectureError(
                    f"model architecture {arch!r} is not supported; supported: "
                    f"{', '.join(sorted(cls._models))} (register others with "
                    f"ModelRegistry.register_model or a {PLUGIN_GROUP!r} entry point){failed}"
                )
            if isinstance(entry, str):
                module, _, name = entry.partition(":")
                try:
                    entry = getattr(importlib.import_module(module), name)
                except (ImportError, AttributeError) as exc:
                    raise UnknownArchitectureError(
                        f"model architecture {arch!r}: cannot import {cls._models[arch]!r}: {exc}"
                    ) from exc
                cls._models[arch] = entry
            return cast("type[CausalLM]", entry)  # a class of the model contract

    @classmethod
    def load_plugins(cls) -> None:
        """Load and call every `pdserve.model_plugins` entry point, once per process. A plugin
        that fails is logged and named in later unknown-architecture errors."""
        with cls._lock:
            if cls._plugins_loaded:
                return
            cls._plugins_loaded = True  # set first: a plugin may call back into the registry
            for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
                try:
                    ep.load()()
                except Exception as exc:  # a broken plugin must not take the others down
                    log.exception("model plugin %r (%s) failed", ep.name, ep.value)
                    cls._failed_plugins[ep.name] = f"{type(exc).__name__}: {exc}"
