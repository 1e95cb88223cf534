"""EngineConfig on the command line: every field has a vLLM-named flag whose default is the
field's default."""

import argparse
import dataclasses

import pytest

from engine.checks import FieldError
from engine.config import EngineConfig, LoRAModule, add_engine_args
from engine.flags import to_argv


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return EngineConfig.from_args(parser.parse_args(argv))


def test_every_field_has_a_flag_and_defaults_match():
    assert _parse([]) == EngineConfig()
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    dests = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= dests


def test_generation_config_flag():
    assert _parse(["--generation-config", "vllm"]).generation_config == "vllm"
    assert _parse(["--generation-config", "/models/x"]).generation_config == "/models/x"


def test_vllm_enforce_eager_and_cuda_graph_sizes_flags():
    """vLLM's flags for CUDA graphs (engine/runner/cuda_graphs.py): `--enforce-eager` turns them
    off, `--cuda-graph-sizes` names the sizes; both round-trip through the command line."""
    assert _parse(["--enforce-eager"]) == dataclasses.replace(EngineConfig(), enforce_eager=True)
    assert to_argv(EngineConfig(enforce_eager=True)) == ["--enforce-eager"]
    config = _parse(["--cuda-graph-sizes", "1", "8", "64"])
    assert config.cuda_graph_sizes == (1, 8, 64)
    assert to_argv(config) == ["--cuda-graph-sizes", "1", "8", "64"]


def test_every_flag_says_what_it_does():
    """Help is the docstring under each field: a field without one is an undocumented flag."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    undocumented = [a.option_strings[0] for a in parser._actions if a.dest != "help" and not a.help]
    assert not undocumented


def test_lora_modules_are_parsed_once_into_name_and_path():
    config = _parse(["--enable-lora", "--lora-modules", "a=/x", "b=/y=z"])
    assert config.lora_modules == (LoRAModule("a", "/x"), LoRAModule("b", "/y=z"))
    assert dict(config.lora_modules) == {"a": "/x", "b": "/y=z"}
    assert EngineConfig(enable_lora=True, lora_modules=("a=/x", LoRAModule("b", "/y=z"))) == config
    for bad in ("a", "=/x", "a="):
        with pytest.raises(
            FieldError, match=f"^--lora-modules: lora_modules must be name=path, got '{bad}'$"
        ):
            _parse(["--enable-lora", "--lora-modules", bad])
    with pytest.raises(FieldError, match="^--lora-modules: lora_modules needs enable_lora"):
        _parse(["--lora-modules", "a=/x"])


def test_a_bad_speculative_config_names_the_flag_not_a_key_that_shares_a_field_name():
    # "model" is also an EngineConfig field: the error must still point at --speculative-config.
    with pytest.raises(
        FieldError, match="^--speculative-config: speculative_config: model must name"
    ) as info:
        _parse(["--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 2}'])
    assert info.value.field == "speculative_config"
