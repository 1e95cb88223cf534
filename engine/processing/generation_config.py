"""Sampling defaults from a model's `generation_config.json`, as vLLM's
`--generation-config auto` applies them: a request that omits one of these fields gets the
model's value instead of the engine's built-in default.

`source` is "auto" (the model's own file), "vllm" (none: built-in defaults only) or a folder
holding a `generation_config.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json name -> SamplingParams field. vLLM reads exactly these.
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(generation_config: dict[str, Any] | None) -> dict[str, Any]:
    """SamplingParams field -> value, for the fields the generation config sets."""
    config = generation_config or {}
    return {
        ours: config[theirs] for theirs, ours in _FIELDS.items() if config.get(theirs) is not None
    }


def load_generation_config(source: str, model_config: dict[str, Any] | None) -> dict[str, Any]:
    """The generation config `source` names; `model_config` is the model's own (auto)."""
    if source == "auto":
        return dict(model_config or {})
    if source == "vllm":
        return {}
    path = Path(source).expanduser() / "generation_config.json"
    if not path.is_file():
        raise ValueError(
            f"--generation-config must be auto, vllm or a folder with "
            f"generation_config.json; {path} does not exist"
        )
    return json.loads(path.read_text())
