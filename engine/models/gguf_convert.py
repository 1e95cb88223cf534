"""Turn a LLaMA-architecture GGUF file into HF-format pieces: config, fp32 state dict and a
`tokenizers` tokenizer. Used both by model preparation (written to disk once) and by loading
a GGUF file directly."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.models.errors import ModelFileError


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


# GGUF tensor name -> HF name: the model's own, then each layer's.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def _read_llama_gguf(path: Path):
    """A GGUF reader over `path`; ModelFileError unless it is a readable LLaMA GGUF file."""
    import gguf

    if not path.is_file():
        raise ModelFileError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises assorted errors on garbage input
        raise ModelFileError(f"{path} is not a readable GGUF file: {exc}") from exc
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelFileError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
    return reader


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ModelFileError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


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


def _tokenizer_json(tokens: list[str], merges: list[str], token_types: list[int]) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    # llama.cpp's "smollm" pre-tokenizer: every digit on its own, then GPT-2 byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, token_types)
        if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_special_tokens(special)
    return tok.to_str()


def convert_gguf(path: Path) -> ConvertedModel:
    """Read and dequantize a LLaMA GGUF file into HF-format config, weights and tokenizer."""
    reader = _read_llama_gguf(path)
    num_heads = int(_field(reader, "llama.attention.head_count"))
    num_kv_heads = int(_field(reader, "llama.attention.head_count_kv", num_heads))
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    state = _state_dict(reader, path, num_heads, num_kv_heads)
    special = _special_tokens(reader)
    config = _model_config(reader, num_heads, num_kv_heads, len(tokens), special,
                           tie_word_embeddings="lm_head.weight" not in state)
    tokenizer_json = _tokenizer_json(
        tokens,
        list(_field(reader, "tokenizer.ggml.merges")),
        list(_field(reader, "tokenizer.ggml.token_type")),
    )
    tokenizer_config = _tokenizer_config(reader, tokens, special, config["max_position_embeddings"])
    generation_config = {"bos_token_id": special.bos, "eos_token_id": special.eos,
                         "pad_token_id": special.pad}
    return ConvertedModel(config, state, tokenizer_json, tokenizer_config, generation_config)


def _state_dict(reader, path: Path, num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor]:
    """Every tensor the HF model uses, dequantized to fp32 under its HF name, Q/K un-permuted."""
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        array = _dequantize(tensor, path)  # unused tensors too: a corrupt one fails the file
        hf_name = _hf_name(tensor.name)
        if hf_name is None:
            continue  # e.g. rope_freqs for other variants; not used by this architecture
        if ".self_attn.q_proj." in hf_name:
            array = unpermute_rope(array, num_heads)
        elif ".self_attn.k_proj." in hf_name:
            array = unpermute_rope(array, num_kv_heads)
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(array))
    if "model.embed_tokens.weight" not in state:
        raise ModelFileError(f"{path}: no token embedding tensor")
    return state


def _dequantize(tensor, path: Path) -> np.ndarray:
    """A GGUF tensor as fp32 in HF's (row-major, reversed GGUF) shape."""
    import gguf

    try:
        array = gguf.dequantize(tensor.data, tensor.tensor_type)
    except Exception as exc:
        raise ModelFileError(f"{path}: cannot dequantize tensor {tensor.name}: {exc}") from exc
    return np.array(array.reshape(tuple(reversed([int(d) for d in tensor.shape]))), dtype=np.float32)


def _hf_name(name: str) -> str | None:
    """The HF name of a GGUF tensor; None if HF's LLaMA has no such tensor."""
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    return _GLOBAL_TENSORS.get(name)


def _special_tokens(reader) -> _SpecialTokens:
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id", 2))
    return _SpecialTokens(
        bos=int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos=eos,
        pad=int(_field(reader, "tokenizer.ggml.padding_token_id", eos)),
        unk=int(_field(reader, "tokenizer.ggml.unknown_token_id", 0)),
    )


def _model_config(reader, num_heads: int, num_kv_heads: int, vocab_size: int,
                  special: _SpecialTokens, tie_word_embeddings: bool) -> dict[str, Any]:
    """HF config.json of the LLaMA model the GGUF file describes."""
    hidden = int(_field(reader, "llama.embedding_length"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": special.bos,
        "eos_token_id": special.eos,
        "pad_token_id": special.pad,
        "torch_dtype": "float32",
    }


def _tokenizer_config(reader, tokens: list[str], special: _SpecialTokens,
                      model_max_length: int) -> dict[str, Any]:
    """HF tokenizer_config.json, chat template included."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[special.bos],
        "eos_token": tokens[special.eos],
        "pad_token": tokens[special.pad],
        "unk_token": tokens[special.unk],
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": str(_field(reader, "tokenizer.chat_template", "")) or None,
    }


def write_hf_dir(model: ConvertedModel, out_dir: Path) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(model.config, indent=2))
    (out_dir / "tokenizer.json").write_text(model.tokenizer_json)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(model.tokenizer_config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(model.generation_config, indent=2))
