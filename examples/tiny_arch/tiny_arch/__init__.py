"""An out-of-tree architecture for pdserve: `TinyForCausalLM`.

`register` is the `pdserve.model_plugins` entry point (pyproject.toml): pdserve calls it in
every process before it resolves a checkpoint's architecture. The class is named by string so
that registering costs no torch import."""

ARCHITECTURE = "TinyForCausalLM"


def register() -> None:
    from engine.models.registry import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, "tiny_arch.model:TinyForCausalLM")
