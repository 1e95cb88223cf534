"""engine.flags: a frozen config's fields are its flags (name, type, default, choices, help from
the docstring) and `to_argv` gives the flags that rebuild a config."""

import argparse
import dataclasses
import enum
from dataclasses import dataclass
from typing import Literal

import pytest

from engine.checks import FieldError, check_fields
from engine.flags import add_flags, from_args, option, to_argv


class Color(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Inner:
    depth: int = 1
    """How deep."""

    def __post_init__(self) -> None:
        check_fields(self, [(self.depth >= 0, "depth", "must be >= 0")])


@dataclass(frozen=True)
class Sample:
    name: str = option(cli=False)
    """Not a flag: the caller passes it."""
    endpoint: str = option(metavar="HOST:PORT")
    """Required: no default."""
    timeout_s: float = option(2.5, name="--timeout")
    """Seconds; the flag keeps its older name."""
    color: Color = Color.RED
    """An enum: its values are the choices."""
    mode: Literal["a", "b"] = "a"
    """A Literal: its values are the choices."""
    size: str = option("s", choices=("s", "m", "l"))
    """Choices from the field's option."""
    limit: int | None = None
    """Optional: None means not given (100% honest)."""
    verbose: bool = False
    """Off by default: --verbose."""
    cache: bool = True
    """On by default: --cache / --no-cache."""
    items: tuple[str, ...] = ()
    """--items A B."""
    extra: tuple[str, ...] = option((), name="--extra-arg", repeat=True)
    """One value per --extra-arg."""
    inner: Inner = option(default_factory=Inner, group="inner things")
    """The nested config's group description."""

    def __post_init__(self) -> None:
        check_fields(self, [(self.timeout_s > 0, "timeout_s", "must be > 0")])


def _parser(cls=Sample) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, cls, group="sample")
    return parser


def _actions(parser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


def test_fields_become_flags_with_their_types_defaults_choices_and_docstrings():
    parser = _parser()
    actions = _actions(parser)
    assert "--name" not in actions
    assert actions["--endpoint"].required and actions["--endpoint"].metavar == "HOST:PORT"
    assert actions["--timeout"].default == 2.5 and actions["--timeout"].type is float
    assert actions["--timeout"].help == "Seconds; the flag keeps its older name."
    assert actions["--color"].choices == [Color.RED, Color.BLUE]
    assert actions["--mode"].choices == ["a", "b"] and actions["--size"].choices == ["s", "m", "l"]
    assert actions["--limit"].default is None and actions["--limit"].type is int
    assert (
        actions["--limit"].help == "Optional: None means not given (100%% honest)."
    )  # argparse escape
    assert isinstance(actions["--verbose"], argparse._StoreTrueAction)
    assert "--no-cache" in actions and actions["--cache"].default is True
    assert actions["--items"].nargs == "+" and isinstance(
        actions["--extra-arg"], argparse._AppendAction
    )
    groups = {g.title: g for g in parser._action_groups}
    assert groups["inner things"].description == "The nested config's group description."
    assert [a.dest for a in groups["inner things"]._group_actions] == ["inner.depth"]
    assert actions["--endpoint"] in groups["sample"]._group_actions


def test_from_args_builds_the_tree_and_to_argv_reproduces_it():
    parser = _parser()
    default = from_args(Sample, parser.parse_args(["--endpoint", "h:1"]), name="n")
    assert default == Sample(name="n", endpoint="h:1")
    assert to_argv(default) == ["--endpoint", "h:1"]  # required flags always; defaults never
    config = Sample(
        name="n",
        endpoint="h:2",
        timeout_s=0.5,
        color=Color.BLUE,
        mode="b",
        size="l",
        limit=-3,
        verbose=True,
        cache=False,
        items=("x", "y"),
        extra=("--a=1", "-b"),
        inner=Inner(depth=4),
    )
    assert all(
        getattr(config, f.name) != getattr(default, f.name)
        for f in dataclasses.fields(Sample)
        if f.name != "name"
    )
    argv = to_argv(config)
    assert argv == [
        "--endpoint",
        "h:2",
        "--timeout",
        "0.5",
        "--color",
        "blue",
        "--mode",
        "b",
        "--size",
        "l",
        "--limit=-3",
        "--verbose",
        "--no-cache",
        "--items",
        "x",
        "y",
        "--extra-arg=--a=1",
        "--extra-arg=-b",
        "--depth",
        "4",
    ]
    assert from_args(Sample, parser.parse_args(argv), name="n") == config


def test_a_bad_value_names_its_flag():
    parser = _parser()
    with pytest.raises(FieldError, match="^--timeout: timeout_s must be > 0, got 0.0$") as info:
        from_args(Sample, parser.parse_args(["--endpoint", "h", "--timeout", "0"]), name="n")
    assert info.value.field == "timeout_s"
    with pytest.raises(FieldError, match="^--depth: depth must be >= 0, got -1$"):
        from_args(Sample, parser.parse_args(["--endpoint", "h", "--depth=-1"]), name="n")
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'green'"):
        parser.parse_args(["--endpoint", "h", "--color", "green"])


def test_a_value_no_flag_can_say_is_refused_by_name():
    @dataclass(frozen=True)
    class Defaults:
        n: int | None = 3
        names: tuple[str, ...] = ("a",)

    with pytest.raises(ValueError, match="--n cannot say None"):
        to_argv(Defaults(n=None))
    with pytest.raises(ValueError, match="--names cannot say an empty list"):
        to_argv(Defaults(names=()))


def test_a_type_without_a_parser_is_refused_when_the_flags_are_built():
    @dataclass(frozen=True)
    class Odd:
        when: complex = 0j

    with pytest.raises(TypeError, match=r"Odd.when: say how --when text becomes"):
        _parser(Odd)


def test_a_class_without_source_gets_flags_without_help():
    cls = dataclasses.make_dataclass(
        "Made", [("count", int, dataclasses.field(default=2))], frozen=True
    )
    parser = _parser(cls)
    assert _actions(parser)["--count"].help is None
    assert from_args(cls, parser.parse_args(["--count", "5"])) == cls(count=5)
