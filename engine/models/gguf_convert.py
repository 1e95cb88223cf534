"""Turn a GGUF file (LLaMA, Qwen2, Qwen3, Gemma 2, Gemma 3: engine/models/gguf_families.py)
into HF-format pieces: config, fp32 state dict and a `tokenizers` tokenizer. Used both by
model preparation (written to disk once) and by loading a GGUF file directly."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.models.errors import ModelFileError
from engine.models.gguf_families import GgufFamily, Metadata, family_of, hf_config, hf_tensor_name
from engine.models.gguf_reader import GgufFile, dequantize, read_gguf
from engine.models.gguf_tokenizer import tokenizer_json


@dataclass(frozen=True)
class ConvertedModel:
    config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _SpecialTokens:
    """Token ids the GGUF metadata names; where absent bos 1, eos 2, pad = eos, unk 0."""

    bos: int
    eos: int
    pad: int
    unk: int


def _read_gguf(path: Path) -> tuple[GgufFile, Metadata]:
    """The GGUF file at `path` and its metadata; ModelFileError unless it is a readable GGUF
    file of a supported architecture."""
    gguf_file = read_gguf(path)
    meta = Metadata(gguf_file.fields, frozenset(t.name for t in gguf_file.tensors))
    try:
        family_of(meta)
    except ModelFileError as exc:
        raise ModelFileError(f"{path}: {exc}") from None
    return gguf_file, meta


def unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (it interleaves the two rotary halves of each
    head; HF's LLaMA expects them as two contiguous halves)."""
    out_features = weight.shape[0]
    head_dim = out_features // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def convert_gguf(path: Path) -> ConvertedModel:
    """Read and dequantize a GGUF file into HF-format config, weights and tokenizer."""
    gguf_file, meta = _read_gguf(path)
    family = family_of(meta)
    tokens = list(meta.get("tokenizer.ggml.tokens"))
    state = _state_dict(gguf_file, path, meta, family)
    special = _special_tokens(meta)
    config = hf_config(
        meta,
        len(tokens),
        tie_word_embeddings="lm_head.weight" not in state,
        special={
            "bos_token_id": special.bos,
            "eos_token_id": special.eos,
            "pad_token_id": special.pad,
        },
    )
    tok_json = tokenizer_json(
        meta.arch,
        str(meta.get("tokenizer.ggml.model")),
        str(meta.get("tokenizer.ggml.pre", "default")),
        tokens,
        list(meta.get("tokenizer.ggml.token_type")),
        meta.get("tokenizer.ggml.merges", None),
        unk_token=tokens[special.unk],
    )
    tokenizer_config = _tokenizer_config(meta, tokens, special, config["max_position_embeddings"])
    generation_config = {
        "bos_token_id": special.bos,
        "eos_token_id": special.eos,
        "pad_token_id": special.pad,
    }
    return ConvertedModel(config, state, tok_json, tokenizer_config, generation_config)


def _state_dict(
    gguf_file: GgufFile, path: Path, meta: Metadata, family: GgufFamily
) -> dict[str, torch.Tensor]:
    """Every tensor the HF model uses, dequantized to fp32 under its HF name, with llama.cpp's
    transforms undone: Q/K un-permuted (LLaMA), norm offsets subtracted (Gemma)."""
    num_heads = int(meta.of_arch("attention.head_count"))
    num_kv_heads = int(meta.of_arch("attention.head_count_kv", num_heads))
    state: dict[str, torch.Tensor] = {}
    for tensor in gguf_file.tensors:
        try:  # unused tensors too: a corrupt one fails the file
            array = dequantize(tensor)
        except Exception as exc:
            raise ModelFileError(f"{path}: cannot dequantize tensor {tensor.name}: {exc}") from exc
        hf_name = hf_tensor_name(family, tensor.name)
        if hf_name is None:
            continue  # e.g. rope_freqs: derived from the config on the HF side
        if family.unpermute_qk and hf_name.endswith(".self_attn.q_proj.weight"):
            array = unpermute_rope(array, num_heads)
        elif family.unpermute_qk and hf_name.endswith(".self_attn.k_proj.weight"):
            array = unpermute_rope(array, num_kv_heads)
        elif family.norm_offset and tensor.name.endswith("norm.weight"):
            array = array - np.float32(family.norm_offset)
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(array))
    if "model.embed_tokens.weight" not in state:
        raise ModelFileError(f"{path}: no token embedding tensor")
    return state


def _special_tokens(meta: Metadata) -> _SpecialTokens:
    eos = int(meta.get("tokenizer.ggml.eos_token_id", 2))
    return _SpecialTokens(
        bos=int(meta.get("tokenizer.ggml.bos_token_id", 1)),
        eos=eos,
        pad=int(meta.get("tokenizer.ggml.padding_token_id", eos)),
        unk=int(meta.get("tokenizer.ggml.unknown_token_id", 0)),
    )


def _tokenizer_config(
    meta: Metadata, tokens: list[str], special: _SpecialTokens, model_max_length: int
) -> dict[str, Any]:
    """HF tokenizer_config.json, chat template included (None where the file has none).
    llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise."""
    sentencepiece = meta.get("tokenizer.ggml.model") == "llama"
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[special.bos],
        "eos_token": tokens[special.eos],
        "pad_token": tokens[special.pad],
        "unk_token": tokens[special.unk],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", sentencepiece)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": str(meta.get("tokenizer.chat_template", "")) or None,
    }


def write_hf_dir(model: ConvertedModel, out_dir: Path) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(model.config, indent=2))
    (out_dir / "tokenizer.json").write_text(model.tokenizer_json)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(model.tokenizer_config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(model.generation_config, indent=2))
