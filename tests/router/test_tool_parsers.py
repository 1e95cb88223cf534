"""The tool call parsers (router/parsers/tools/): each format's fixtures (complete, partial,
malformed,
several calls, calls inside text, unknown tools, escapes and unicode) parse to the expected
content and calls; feeding any fixture in pieces (char by char, random cuts, 3-char
"tokens") gives what feeding it whole gives; a parser holds back no more than a marker
prefix; streamed arguments are always a valid JSON prefix and a complete call's are a JSON
object; plugins and unknown names. The structural tags: test_tool_structural_tags.py."""

import json
import random

import pytest

from router.parsers.tools import base
from router.parsers.tools.json_prefix import valid_prefix
from router.parsers.tools.parser import load_tool_parser_plugin, tool_parser, tool_parser_names
from router.parsers.tools.types import FunctionTool, ParsedDelta, ToolCallDelta, assemble

WEATHER = FunctionTool(
    "get_weather",
    "The weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
)
TIME = FunctionTool("get_time")
TOOLS = [WEATHER, TIME]
PARIS = {"city": "Paris"}
ODD = {"city": 'São "Paulo"\n\\', "note": "日本 🌧"}
ODD_JSON = r'{"city": "S\u00e3o \"Paulo\"\n\\", "note": "日本 🌧"}'
NOT_THERE = "get_stock_price"

# (parser, case, text, content, calls, broken). A call is (name, arguments): a dict for a
# complete call (compared as JSON), the exact text for a broken one.
CASES = [
    (
        "hermes",
        "one",
        'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>',
        "I will check.\n",
        [("get_weather", PARIS)],
        False,
    ),
    (
        "hermes",
        "several",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
        "",
        [("get_weather", PARIS), ("get_time", {})],
        False,
    ),
    (
        "hermes",
        "text_after",
        '<tool_call>{"name": "get_time", "parameters": {}}</tool_call>\nDone.',
        "\nDone.",
        [("get_time", {})],
        False,
    ),
    (
        "hermes",
        "no_arguments",
        '<tool_call>\n{"name": "get_time"}\n</tool_call>',
        "",
        [("get_time", {})],
        False,
    ),
    (
        "hermes",
        "escapes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {ODD_JSON}}}\n</tool_call>',
        "",
        [("get_weather", ODD)],
        False,
    ),
    (
        "hermes",
        "partial",
        'x<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        "x",
        [("get_weather", '{"city": "Par')],
        True,
    ),
    (
        "hermes",
        "partial_name",
        'Hi <tool_call>\n{"name": "get_wea',
        'Hi <tool_call>\n{"name": "get_wea',
        [],
        False,
    ),
    (
        "hermes",
        "malformed",
        "<tool_call>\n{name: get_weather}\n</tool_call> ok",
        "<tool_call>\n{name: get_weather}\n</tool_call> ok",
        [],
        False,
    ),
    (
        "hermes",
        "broken_arguments",
        '<tool_call>\n{"name": "get_time", "arguments": {"a": 1,,}}\n</tool_call> after',
        ",}}\n</tool_call> after",
        [("get_time", '{"a": 1,')],
        True,
    ),
    (
        "hermes",
        "unknown",
        f'<tool_call>\n{{"name": "{NOT_THERE}", "arguments": {{}}}}\n</tool_call>',
        f'<tool_call>\n{{"name": "{NOT_THERE}", "arguments": {{}}}}\n</tool_call>',
        [],
        False,
    ),
    ("hermes", "plain", "No tools <needed> here.", "No tools <needed> here.", [], False),
    (
        "llama3_json",
        "python_tag",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", PARIS)],
        False,
    ),
    (
        "llama3_json",
        "several",
        '{"name": "get_weather", "parameters": {"city": "Paris", '
        '"days": 3}}; {"name": "get_time", "arguments": {}}',
        "",
        [("get_weather", {**PARIS, "days": 3}), ("get_time", {})],
        False,
    ),
    (
        "llama3_json",
        "in_text",
        'Let me look. {"name": "get_time", "parameters": {}} then',
        "Let me look.  then",
        [("get_time", {})],
        False,
    ),
    (
        "llama3_json",
        "other_json",
        'Here: {"name": "Bob", "age": 3} and {x}',
        'Here: {"name": "Bob", "age": 3} and {x}',
        [],
        False,
    ),
    ("llama3_json", "code", "fn main() { let x = {}; }", "fn main() { let x = {}; }", [], False),
    (
        "llama3_json",
        "escapes",
        f'{{"name": "get_weather", "parameters": {ODD_JSON}}}',
        "",
        [("get_weather", ODD)],
        False,
    ),
    (
        "llama3_json",
        "partial",
        '{"name": "get_weather", "parameters": {"city": ["a", tr',
        "",
        [("get_weather", '{"city": ["a", tr')],
        True,
    ),
    ("llama3_json", "python_code", "<|python_tag|>print(1)", "<|python_tag|>print(1)", [], False),
    (
        "llama3_json",
        "unknown",
        f'{{"name": "{NOT_THERE}", "parameters": {{}}}}',
        f'{{"name": "{NOT_THERE}", "parameters": {{}}}}',
        [],
        False,
    ),
    (
        "mistral",
        "list",
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
        "Sure. ",
        [("get_weather", PARIS), ("get_time", {})],
        False,
    ),
    (
        "mistral",
        "named",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time'
        "[CALL_ID]a1B2c3D4e[ARGS]{}",
        "",
        [("get_weather", PARIS), ("get_time", {})],
        False,
    ),
    (
        "mistral",
        "named_no_args_token",
        '[TOOL_CALLS]get_weather{"city": "Paris"}',
        "",
        [("get_weather", PARIS)],
        False,
    ),
    (
        "mistral",
        "escapes",
        f"[TOOL_CALLS]get_weather[ARGS]{ODD_JSON}",
        "",
        [("get_weather", ODD)],
        False,
    ),
    (
        "mistral",
        "partial",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "P',
        "",
        [("get_weather", '{"city": "P')],
        True,
    ),
    (
        "mistral",
        "malformed",
        '[TOOL_CALLS][{"nam": "get_weather"}]',
        '[TOOL_CALLS][{"nam": "get_weather"}]',
        [],
        False,
    ),
    (
        "mistral",
        "unknown",
        f"[TOOL_CALLS]{NOT_THERE}[ARGS]{{}}",
        f"[TOOL_CALLS]{NOT_THERE}[ARGS]{{}}",
        [],
        False,
    ),
    (
        "mistral",
        "second_unknown",
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, '
        f'{{"name": "{NOT_THERE}", "arguments": {{}}}}]',
        f' {{"name": "{NOT_THERE}", "arguments": {{}}}}]',
        [("get_time", {})],
        False,
    ),
    (
        "granite",
        "marker",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}, {"name": "get_time", "arguments": {}}]',
        "",
        [("get_weather", PARIS), ("get_time", {})],
        False,
    ),
    (
        "granite",
        "bare_list",
        ' [{"name": "get_time", "arguments": {}}]',
        "",
        [("get_time", {})],
        False,
    ),
    (
        "granite",
        "in_text",
        'One moment.<tool_call>[{"name": "get_time", "arguments": {}}] ok',
        "One moment. ok",
        [("get_time", {})],
        False,
    ),
    (
        "granite",
        "escapes",
        f'<|tool_call|>[{{"name": "get_weather", "arguments": {ODD_JSON}}}]',
        "",
        [("get_weather", ODD)],
        False,
    ),
    (
        "granite",
        "partial",
        '<|tool_call|>[{"name": "get_time", "arguments": {"a": {"b": 1',
        "",
        [("get_time", '{"a": {"b": 1')],
        True,
    ),
    ("granite", "reference", "[1] See the manual.", "[1] See the manual.", [], False),
    (
        "granite",
        "unknown",
        f'<|tool_call|>[{{"name": "{NOT_THERE}", "arguments": {{}}}}]',
        f'<|tool_call|>[{{"name": "{NOT_THERE}", "arguments": {{}}}}]',
        [],
        False,
    ),
    (
        "pythonic",
        "several",
        "[get_weather(city='Paris', days=3), get_time()]",
        "",
        [("get_weather", {**PARIS, "days": 3}), ("get_time", {})],
        False,
    ),
    (
        "pythonic",
        "literals",
        "[get_time(a=[1, (2, 3)], b={\"k\": None}, c=True, d=-1.5, e='x,)]')]",
        "",
        [("get_time", {"a": [1, [2, 3]], "b": {"k": None}, "c": True, "d": -1.5, "e": "x,)]"})],
        False,
    ),
    (
        "pythonic",
        "escapes",
        '[get_weather(city=\'S\\u00e3o "Paulo"\\n\\\\\', note="日本 🌧")]',
        "",
        [("get_weather", ODD)],
        False,
    ),
    (
        "pythonic",
        "in_text",
        "Calling [get_time(tz='UTC')] now",
        "Calling  now",
        [("get_time", {"tz": "UTC"})],
        False,
    ),
    (
        "pythonic",
        "link",
        "See [the docs](http://x) [1, 2]",
        "See [the docs](http://x) [1, 2]",
        [],
        False,
    ),
    (
        "pythonic",
        "positional",
        "[get_weather('Paris')] x",
        "'Paris')] x",
        [("get_weather", "")],
        True,
    ),
    (
        "pythonic",
        "not_literal",
        "[get_weather(city=paris)]",
        "paris)]",
        [("get_weather", "")],
        True,
    ),
    (
        "pythonic",
        "partial",
        "[get_weather(city='Paris', days=3",
        "",
        [("get_weather", '{"city": "Paris"')],
        True,
    ),
    ("pythonic", "unknown", f"[{NOT_THERE}(x=1)]", f"[{NOT_THERE}(x=1)]", [], False),
    (
        "pythonic",
        "long_strings",
        "[get_time(a='''x\ny ''z''', b=\"\"\"q\\\"\"\"\")]",
        "",
        [("get_time", {"a": "x\ny ''z", "b": 'q"'})],
        False,
    ),
    ("pythonic", "partial_string", "[get_time(a=1, b='ab", "", [("get_time", '{"a": 1')], True),
    (
        "pythonic",
        "line_end_in_string",
        "[get_time(a='x\ny')] z",
        "'x\ny')] z",
        [("get_time", "")],
        True,
    ),
    (
        "pythonic",
        "nested_call",
        "[get_time(a=1, b=[get_time(c=2)])] z",
        "[get_time(c=2)])] z",
        [("get_time", '{"a": 1')],
        True,
    ),
]


def _feed(name: str, pieces: list[str]) -> tuple[list[ParsedDelta], bool]:
    parser = tool_parser(name)(TOOLS)
    deltas = [parser.feed(piece) for piece in pieces]
    deltas.append(parser.finish())
    return deltas, parser.broken


def _result(deltas: list[ParsedDelta]) -> tuple[str, list[tuple[str, str]]]:
    calls = assemble([d for delta in deltas for d in delta.tool_calls])
    return "".join(d.content for d in deltas), [(c.name, c.arguments) for c in calls]


def _splits(text: str) -> dict[str, list[str]]:
    out = {"chars": list(text), "tokens": [text[i : i + 3] for i in range(0, len(text), 3)]}
    for seed in range(3):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, len(text) // 4)))
        out[f"random{seed}"] = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return out


@pytest.mark.parametrize(
    "name,case,text,content,calls,broken", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_whole_text(name, case, text, content, calls, broken):
    deltas, was_broken = _feed(name, [text])
    got_content, got_calls = _result(deltas)
    assert got_content == content
    assert [n for n, _ in got_calls] == [n for n, _ in calls]
    for (_, got), (_, want) in zip(got_calls, calls):
        assert (json.loads(got) if isinstance(want, dict) else got) == want
    assert was_broken == broken


@pytest.mark.parametrize(
    "name,case,text,content,calls,broken", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_pieces_give_what_the_whole_gives(name, case, text, content, calls, broken):
    whole = _result(_feed(name, [text])[0])
    for split, pieces in _splits(text).items():
        deltas, was_broken = _feed(name, pieces)
        assert _result(deltas) == whole, split
        assert was_broken == broken, split
        _check_call_pieces(deltas, complete=not broken)


def _check_call_pieces(deltas: list[ParsedDelta], complete: bool) -> None:
    """Calls are announced once, in order, with unique ids; their arguments are a valid
    JSON prefix after every delta, and a JSON object at the end of a complete call."""
    args: dict[int, str] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.index not in args:
                assert piece.index == len(args) and piece.id and piece.name
                args[piece.index] = ""
            else:
                assert piece.id is None and piece.name is None
            args[piece.index] += piece.arguments
        for text in args.values():
            assert valid_prefix(text)[0] == len(text)
    ids = [p.id for d in deltas for p in d.tool_calls if p.id]
    assert len(set(ids)) == len(ids)
    if complete:
        assert all(isinstance(json.loads(text), dict) for text in args.values())


PLAIN = "The weather in Paris is mild today, thanks for asking!"


@pytest.mark.parametrize("name", tool_parser_names())
def test_text_without_markers_goes_out_at_once(name):
    parser = tool_parser(name)(TOOLS)
    for c in PLAIN:
        assert parser.feed(c).content == c
    assert not parser.finish()


@pytest.mark.parametrize(
    "name,marker",
    [
        ("hermes", "<tool_call>"),
        ("mistral", "[TOOL_CALLS]"),
        ("granite", "<|tool_call|>"),
        ("llama3_json", "<|python_tag|>"),
    ],
)
def test_only_a_marker_prefix_is_held(name, marker):
    parser = tool_parser(name)(TOOLS)
    assert parser.feed("Well " + marker[:-1]).content == "Well "
    assert parser.feed("!").content == marker[:-1] + "!"
    assert parser.feed(marker[:3]).content == ""
    assert parser.finish().content == marker[:3]


def test_a_call_is_announced_once_its_arguments_begin():
    parser = tool_parser("hermes")(TOOLS)
    assert not parser.feed('<tool_call>\n{"name": "get_weather", "arguments": ')
    delta = parser.feed('{"ci')
    assert [(d.index, d.name, d.arguments) for d in delta.tool_calls] == [
        (0, "get_weather", '{"ci')
    ]
    assert parser.feed('ty": "Paris"}}').tool_calls[0].arguments == 'ty": "Paris"}'


def test_pieces_carry_openai_shapes():
    first = ToolCallDelta(0, "call_1", "get_time", "{")
    assert first.to_openai() == {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_time", "arguments": "{"},
    }
    assert ToolCallDelta(0, arguments="}").to_openai() == {
        "index": 0,
        "function": {"arguments": "}"},
    }


def test_plugin_registers_a_parser(tmp_path):
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from router.parsers.tools.parser import ToolParser, register_tool_parser\n"
        "from router.parsers.tools.types import ParsedDelta\n\n"
        "@register_tool_parser('test_plugin_parser')\n"
        "class Mine(ToolParser):\n"
        "    def feed(self, text):\n"
        "        return ParsedDelta(content=text.upper())\n\n"
        "    def finish(self):\n"
        "        return ParsedDelta()\n"
    )
    try:
        load_tool_parser_plugin(str(plugin))
        cls = tool_parser("test_plugin_parser")
        assert cls.__name__ == "Mine" and cls([]).feed("ab").content == "AB"
        assert "test_plugin_parser" in tool_parser_names()
    finally:
        base.TOOL_PARSERS.remove("test_plugin_parser")
    with pytest.raises(ValueError, match="no such file"):
        load_tool_parser_plugin(str(tmp_path / "absent.py"))


def test_a_plugin_replaces_a_built_in(tmp_path):
    plugin = tmp_path / "my_hermes.py"
    plugin.write_text(
        "from router.parsers.tools.parser import register_tool_parser\n"
        "from router.parsers.tools.hermes import HermesToolParser\n\n"
        "@register_tool_parser('hermes')\n"
        "class MyHermes(HermesToolParser):\n"
        "    pass\n"
    )
    built_in = tool_parser("hermes")
    try:
        load_tool_parser_plugin(str(plugin))
        assert tool_parser("hermes").__name__ == "MyHermes"
    finally:
        base.register_tool_parser("hermes")(built_in)
    assert tool_parser("hermes") is built_in


def test_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError) as info:
        tool_parser("nope")
    for name in ("granite", "hermes", "llama3_json", "mistral", "pythonic"):
        assert name in str(info.value)


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|tool_call|>",
    "<|python_tag|>",
    '{"name": ',
    '"get_time"',
    ', "arguments": ',
    "{}",
    "}",
    "]",
    "[",
    ",",
    ";",
    " ",
    "\n",
    "get_time",
    "(",
    ")",
    "x=",
    "'x'",
    "3",
    '"',
    "\\",
    "{",
    "<",
    "é",
]


@pytest.mark.parametrize("name", tool_parser_names())
def test_mutated_texts_stream_as_they_parse_whole(name):
    """The format's fixtures, joined, with fragments put in and the end cut off at random."""
    rng = random.Random(1)
    texts = [case[2] for case in CASES if case[0] == name]
    for _ in range(150):
        parts = [rng.choice(texts) for _ in range(rng.randrange(1, 4))]
        for _ in range(rng.randrange(3)):
            parts.insert(rng.randrange(len(parts) + 1), rng.choice(FRAGMENTS))
        text = "".join(parts)
        text = text[: rng.randrange(len(text) // 2, len(text) + 1)] or "x"
        whole = _feed(name, [text])
        for split, pieces in _splits(text).items():
            deltas, broken = _feed(name, pieces)
            assert (_result(deltas), broken) == (_result(whole[0]), whole[1]), (split, text)
            _check_call_pieces(deltas, complete=False)


@pytest.mark.parametrize("name", ["hermes", "mistral"])
def test_long_text_and_arguments_stream_past_the_buffer_cut(name):
    long = "x\\n\\u00e9" * 2000
    call = {
        "hermes": f'<tool_call>{{"name": "get_time", "arguments": {{"s": "{long}"}}}}</tool_call>',
        "mistral": f'[TOOL_CALLS]get_time[ARGS]{{"s": "{long}"}}',
    }[name]
    text = "y" * 9000 + call + "z" * 9000
    deltas, broken = _feed(name, [text[i : i + 5] for i in range(0, len(text), 5)])
    content, calls = _result(deltas)
    assert content == "y" * 9000 + "z" * 9000 and not broken
    assert calls == [("get_time", f'{{"s": "{long}"}}')]
