"""--max-model-len beyond the model's trained length is refused by name (vLLM's rule), not
silently cut to it; VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 serves it anyway."""

import pytest
import torch

from engine.checks import FieldError
from engine.config import ALLOW_LONG_MAX_MODEL_LEN, resolve_max_model_len


def test_default_and_shorter_lengths_are_served_as_asked(monkeypatch):
    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN, raising=False)
    assert resolve_max_model_len(None, 8192) == 8192
    assert resolve_max_model_len(1024, 8192) == 1024
    assert resolve_max_model_len(8192, 8192) == 8192


def test_a_length_past_the_model_is_refused_by_name(monkeypatch):
    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN, raising=False)
    with pytest.raises(FieldError) as err:
        resolve_max_model_len(33000, 8192)
    assert err.value.field == "max_model_len"
    assert "33000" in str(err.value) and "8192" in str(err.value)
    assert ALLOW_LONG_MAX_MODEL_LEN in str(err.value)


def test_the_vllm_switch_serves_it(monkeypatch, caplog):
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN, "1")
    assert resolve_max_model_len(33000, 8192) == 33000
    assert "exceeds the model's max_position_embeddings" in caplog.text


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_rope_tables_grow_past_the_trained_length_with_the_same_rows_inside_it(scaling):
    """A context served beyond training needs RoPE rows there; the rows inside are unchanged."""
    from engine.models.config import ModelArgs
    from engine.models.rope import rope_cache

    cfg = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_scaling=scaling,
    )
    spec = ModelArgs.from_hf_config(cfg).rope_spec(0)
    trained, longer = rope_cache(spec), rope_cache(spec, min_positions=300)
    assert longer.shape == (300, trained.shape[1])
    assert torch.equal(longer[: len(trained)], trained)
    assert torch.isfinite(longer).all()
