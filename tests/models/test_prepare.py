import json
import shutil

import pytest

from engine.models.gguf_convert import ModelFileError
from engine.models.prepare import bundled_gguf_path, prepare_model

EXPECTED_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
}


def test_prepared_directory_is_standard_hf(model_dir):
    assert EXPECTED_FILES <= {p.name for p in model_dir.iterdir()}
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    ) == (30, 9, 3)
    assert (
        "<|im_start|>"
        in json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    )


def test_prepare_is_idempotent(model_dir):
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert prepare_model(bundled_gguf_path(), model_dir) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_damaged_stamp_prepares_again(model_dir, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(model_dir, out)
    (out / "pdserve-prepared.json").write_text("{not json")
    (out / "model.safetensors").write_bytes(b"garbage")
    prepare_model(bundled_gguf_path(), out)
    assert (out / "model.safetensors").stat().st_size == (
        model_dir / "model.safetensors"
    ).stat().st_size


def test_missing_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        prepare_model(tmp_path / "absent.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all" * 100, "truncated"])
def test_corrupt_gguf_is_a_clear_error(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    if content == "truncated":
        with open(bundled_gguf_path(), "rb") as f:
            content = f.read(1 << 20)  # header and metadata, then cut mid-tensor
    bad.write_bytes(content)
    with pytest.raises(ModelFileError):
        prepare_model(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*")), "a half-written temporary directory was left"
