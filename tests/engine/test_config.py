"""EngineConfig on the command line: every field has a vLLM-named flag whose default is the
field's default."""
import argparse
import dataclasses

from engine.config import EngineConfig, add_engine_args


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
