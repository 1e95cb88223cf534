"""Load a model and its tokenizer from an HF-format directory or a GGUF file.

The class comes from config.json's `architectures[0]` through the ModelRegistry (the built-in
architectures of engine/models/registry.py; out-of-tree ones by plugin); every class
is built with `from_config` and fed the checkpoint's tensors through `load_weights`
(engine/models/interface.py) — the loader knows no architecture. A GGUF file's converted
config names its family (engine/models/gguf_families.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from engine.models.config import ModelArgs
from engine.models.errors import ModelFileError
from engine.models.gguf_convert import convert_gguf
from engine.models.interface import CausalLM
from engine.models.prepare import DEFAULT_MODEL, resolve_model_path
from engine.models.registry import ModelRegistry
from engine.parallel.shard import TPShard
from engine.processing.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    args: ModelArgs
    model_id: str  # what the OpenAI API reports; the directory or file name
    model_dir: Path  # where it was loaded from (an HF directory or a GGUF file)
    architecture: str = "LlamaForCausalLM"  # config.json's architectures[0]


def _safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{model_dir} has no *.safetensors weights")
    return files


def _iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor, one file open at a time."""
    from safetensors import safe_open

    for f in _safetensors_files(model_dir):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def architecture_of(config: dict) -> str:
    """config.json's `architectures[0]` (LLaMA when absent, as older checkpoints have it)."""
    archs = config.get("architectures") or ["LlamaForCausalLM"]
    return archs[0]


def load_model(
    model: str | Path = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    num_layers: int | None = None,
    shard: TPShard | None = None,
) -> LoadedModel:
    """Load weights + tokenizer. `num_layers` keeps only the first N layers (fast tests).
    `shard`: load only tensor-parallel rank `shard.rank`'s part (engine/models/tp_slices.py;
    the built-in decoder architectures only); `LoadedModel.args` are then the rank's."""
    path = resolve_model_path(model)
    if path.is_file():
        converted = convert_gguf(path)
        config, hf_state = converted.config, converted.state_dict
        tokenizer = Tokenizer(
            converted.tokenizer_json, converted.tokenizer_config, converted.generation_config
        )
    else:
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelFileError(f"{path} is neither a GGUF file nor an HF model directory")
        config, hf_state = json.loads(config_file.read_text()), None
    model_cls = ModelRegistry.resolve(architecture_of(config))
    if not path.is_file():
        tokenizer = Tokenizer.from_dir(path)
    if num_layers is not None:
        if "num_hidden_layers" not in config:
            raise ModelFileError(f"{path}: num_layers needs num_hidden_layers in config.json")
        config = {**config, "num_hidden_layers": min(num_layers, config["num_hidden_layers"])}
    weights = _iter_weights(path) if hf_state is None else hf_state.items()
    if shard is None:
        net = model_cls.from_config(config)
    else:
        net, weights = _sharded(model_cls, config, shard, weights)
    try:
        net.load_weights(weights)
    except KeyError as exc:
        raise ModelFileError(f"{path}: weight {exc} is missing or unexpected") from exc
    module = cast(torch.nn.Module, net)  # implementations are modules (interface.CausalLM)
    net = cast(CausalLM, module.to(device=device, dtype=dtype).eval().requires_grad_(False))
    return LoadedModel(
        net,
        tokenizer,
        net.args,
        model_id=path.name,
        model_dir=path,
        architecture=architecture_of(config),
    )


def _sharded(model_cls: type, config: dict, shard: TPShard, weights):
    """The rank's model (uninitialised) and its slices of `weights`."""
    from engine.models.decoder import DecoderLM
    from engine.models.tp_slices import shard_args, slice_weights

    if not (isinstance(model_cls, type) and issubclass(model_cls, DecoderLM)):
        raise ModelFileError(
            f"{architecture_of(config)}: tensor parallelism needs a built-in "
            "decoder architecture (engine/models/decoder.py); this one is a plugin"
        )
    full = model_cls.model_args(config)
    try:
        args = shard_args(full, shard)
    except ValueError as exc:
        raise ModelFileError(f"{architecture_of(config)}: {exc}") from exc
    # args.tp, not `shard`: shard_args fills in the model's sizes (heads, vocabulary) that
    # the slices are cut by.
    assert args.tp is not None
    return model_cls(args), slice_weights(weights, full, args.tp)
