"""Each tool format's structural tag (`ToolParser.structural_tag`) compiles with xgrammar
through the engine's compiler (the bundled SmolLM2 vocabulary); text in the format, calls
between free text included, is accepted token by token, and the parser reads the same calls
back from it; a call whose arguments break the tool's schema, or that names no tool, is
refused. Formats without a marker (pythonic) have no tag."""

import json

import pytest

from engine.processing.tokenizer import Tokenizer
from engine.structured.compile_process import CompileLimits
from engine.structured.compiler import GrammarCompiler
from engine.structured.params import StructuredOutputsParams
from router.parsers.tools.parser import tool_parser, tool_parser_names
from router.parsers.tools.types import FunctionTool, assemble

WEATHER = FunctionTool(
    "get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
)
TIME = FunctionTool("get_time")  # no schema: any object
TOOLS = [WEATHER, TIME]

# (parser, text the grammar accepts, the calls in it)
ACCEPTED = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"tz": "UTC"}}\n</tool_call>',
        ["get_weather", "get_time"],
    ),
    ("hermes", "No call needed.", []),
    (
        "llama3_json",
        'Sure: {"name": "get_weather", "parameters": {"city": "Paris"}}',
        ["get_weather"],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        ["get_weather"],
    ),
    (
        "mistral",
        'Ok.[TOOL_CALLS]get_time[ARGS]{"x": [1, 2]}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
        ["get_time", "get_weather"],
    ),
    (
        "granite",
        'Checking.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        ["get_weather"],
    ),
]
# (parser, text the grammar refuses)
REFUSED = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>',
    ),
    ("hermes", '<tool_call>\n{"name": "get_stock", "arguments": {}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": 3}}'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": "two"}'),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {}}]'),
]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(
        tokenizer, tokenizer.vocab_size, tokenizer.stop_token_ids, CompileLimits(timeout_s=0)
    )


def _matcher(compiler, name):
    tag = tool_parser(name).structural_tag(TOOLS)
    assert tag is not None
    return compiler.matcher(StructuredOutputsParams(structural_tag=json.dumps(tag)))


def test_every_marker_format_has_a_tag_and_pythonic_none():
    for name in tool_parser_names():
        tag = tool_parser(name).structural_tag(TOOLS)
        assert (tag is None) == (name == "pythonic")
        assert tool_parser(name).structural_tag([]) is None


@pytest.mark.parametrize(
    "name,text,calls", ACCEPTED, ids=[f"{a[0]}-{i}" for i, a in enumerate(ACCEPTED)]
)
def test_text_in_the_format_is_accepted_and_parses_back(compiler, tokenizer, name, text, calls):
    state = _matcher(compiler, name)
    ids = tokenizer.encode(text)
    assert state.valid_prefix(ids) == len(ids)
    for token in ids:
        assert state.accept(token)
    assert state.accept(min(tokenizer.stop_token_ids)) and state.terminated
    parser = tool_parser(name)(TOOLS)
    deltas = [parser.feed(text), parser.finish()]
    got = assemble([d for delta in deltas for d in delta.tool_calls])
    assert [c.name for c in got] == calls and not parser.broken


@pytest.mark.parametrize("name,text", REFUSED, ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSED)])
def test_a_call_breaking_the_schema_is_refused(compiler, tokenizer, name, text):
    ids = tokenizer.encode(text)
    assert _matcher(compiler, name).valid_prefix(ids) < len(ids)
