"""Command-line flags from a frozen config dataclass, and the config back from them.

One config path (docs/architecture.md, "One config path"): each `__main__` adds a config's
flags with `add_flags(parser, Config)`, parses once and builds the tree with
`from_args(Config, namespace)`; `pdserve up` goes the other way, `to_argv(config)`, to start a
child process whose config is `config`. Nothing lists a config's flags by hand.

A field is one flag:
- name: `--field-name` (underscores to dashes), unless `option(name=...)` keeps vLLM's or an
  existing one (`--kv-timeout` for `kv_timeout_s`);
- help: the docstring right under the field (read from the class source with `ast`);
- default: the field's; a field without one is a required flag;
- type and choices from the annotation: `int`, `float`, `str`; `X | None` (None: not given);
  an `Enum` or `Literal` (its values are the choices); `bool` (`--flag` when the default is
  False, `--flag/--no-flag` when it is True); `tuple[X, ...]` (`--flag A B`, or one value per
  `--flag` with `option(repeat=True)`); a nested config dataclass (its fields' flags, in a
  group titled `option(group=...)` and described by the field's docstring). Any other type
  needs `option(type=...)` (the text -> value parser argparse calls; the config's
  `__post_init__` may finish the parsing) and, if `str(value)` does not give the flag's text
  back, `option(format=...)`.

Range checks stay in each config's `__post_init__` (engine.checks); `from_args` prefixes the
`FieldError` of a field with its flag, so the command line names what the user typed.

Torch-free and stdlib-only: `pdserve --help` and the router import it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import textwrap
import types
import typing
from typing import Any, Callable, Literal

from engine.checks import FieldError

_KEY = "pdserve.flag"


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one field appears on the command line (kept in the field's metadata)."""

    name: str | None = None
    """The flag (default: --field-name)."""
    aliases: tuple[str, ...] = ()
    """Other spellings argparse accepts (vLLM's short `-tp`); `to_argv` writes `name`."""
    type: Callable[[str], Any] | None = None
    """Text -> value (default: from the annotation)."""
    format: Callable[[Any], str] = str
    """Value -> text, the inverse of `type` (for `to_argv`)."""
    choices: tuple[Any, ...] | None = None
    """Allowed values (default: an Enum's or Literal's)."""
    metavar: str | None = None
    group: str | None = None
    """Title of the help group the flag is listed in (a nested config: its fields' group)."""
    repeat: bool = False
    """A tuple field given as one value per flag (`--x A --x B`) instead of `--x A B`."""
    cli: bool = True
    """False: not a flag; the caller passes the value to `from_args` (a worker's role is its
    subcommand)."""


def option(
    default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **flag: Any
) -> Any:
    """`dataclasses.field` whose flag differs from the default one (see Flag)."""
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={_KEY: Flag(**flag)}
    )


@dataclasses.dataclass(frozen=True)
class _Spec:
    """One field, resolved: what argparse needs and what `to_argv` needs."""

    field: dataclasses.Field
    flag: Flag
    option: str
    kind: str  # "bool", "seq", "nested" or "value"
    type: Any  # the value's (or a sequence item's) type; the config class for "nested"
    help: str | None

    @property
    def name(self) -> str:
        return self.field.name

    def default(self) -> Any:
        f = self.field
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return dataclasses.MISSING


def add_flags(parser: argparse.ArgumentParser, cls: type, *, group: str | None = None) -> None:
    """Add a flag for every field of config class `cls` (nested configs included), listed
    under `group` (a help group title; None: the parser's own list) unless a field names
    its own."""
    _add(parser, cls, "", _group(parser, group) if group else parser)


def from_args(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """The `cls` that `add_flags(parser, cls)`'s parsed `args` describe; `given` supplies the
    fields that are not flags. A bad value raises FieldError naming the flag."""
    return _build(cls, args, "", given)


def to_argv(config: Any) -> list[str]:
    """The arguments that make `add_flags` + `from_args` rebuild `config` (the fields that are
    not flags aside): its non-default fields' flags, in field order. A value no flag can
    express is refused by name (ValueError), never left out."""
    out: list[str] = []
    cls: type = type(config)
    for spec in _specs(cls):
        if not spec.flag.cli:
            continue
        value, default = getattr(config, spec.name), spec.default()
        if spec.kind == "nested":
            out += to_argv(value)
        elif value != default or default is dataclasses.MISSING:
            out += _argv(spec, value)
    return out


# ---- reading the classes -------------------------------------------------------------------


@functools.cache
def _specs(cls: type) -> tuple[_Spec, ...]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints, docs = typing.get_type_hints(cls), _field_docs(cls)
    return tuple(
        _spec(cls, f, hints[f.name], docs.get(f.name)) for f in dataclasses.fields(cls) if f.init
    )


def _spec(cls: type, f: dataclasses.Field, hint: Any, doc: str | None) -> _Spec:
    flag: Flag = f.metadata.get(_KEY, Flag())
    option = flag.name or "--" + f.name.replace("_", "-")
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (hint,) = [a for a in args if a is not type(None)]  # `X | None`: None = not given
    if hint is bool:
        kind = "bool"
    elif dataclasses.is_dataclass(hint) and not flag.type:
        kind = "nested"
    elif typing.get_origin(hint) is tuple and typing.get_args(hint)[1:] == (Ellipsis,):
        kind, hint = "seq", typing.get_args(hint)[0]
    else:
        kind = "value"
    if kind in ("seq", "value") and flag.type is None and not _parses_text(hint):
        raise TypeError(
            f"{cls.__name__}.{f.name}: say how {option} text becomes a {hint!r} (option(type=...))"
        )
    return _Spec(f, flag, option, kind, hint, doc)


def _parses_text(hint: Any) -> bool:
    return (
        hint in (int, float, str)
        or typing.get_origin(hint) is Literal
        or (isinstance(hint, type) and issubclass(hint, enum.Enum))
    )


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """field name -> the string literal right under its annotation, for `cls` and its bases
    (none for a class without source, e.g. one made by `make_dataclass`)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, doc in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)
            ):
                docs[node.target.id] = " ".join(doc.value.value.split())
    return docs


# ---- argparse ------------------------------------------------------------------------------


def _group(parser: argparse.ArgumentParser, title: str, description: str | None = None):
    """The parser's help group `title` (made on first use, so flags of several configs can
    share one)."""
    for g in parser._action_groups:
        if g.title == title:
            return g
    return parser.add_argument_group(title, description)


def _add(parser: argparse.ArgumentParser, cls: type, prefix: str, target) -> None:
    for spec in _specs(cls):
        if not spec.flag.cli:
            continue
        if spec.kind == "nested":
            inner = _group(parser, spec.flag.group, spec.help) if spec.flag.group else target
            _add(parser, spec.type, f"{prefix}{spec.name}.", inner)
            continue
        where = _group(parser, spec.flag.group) if spec.flag.group else target
        kw: dict[str, Any] = {
            "dest": prefix + spec.name,
            "help": (spec.help or "").replace("%", "%%") or None,
        }
        default = spec.default()
        if default is dataclasses.MISSING:
            kw["required"] = True
        else:
            kw["default"] = list(default) if spec.kind == "seq" else default
        if spec.kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction if default is True else "store_true"
        else:
            choices = spec.flag.choices or _choices(spec.type)
            kw["type"] = spec.flag.type or _parser(spec.type)
            kw["metavar"] = spec.flag.metavar or (
                None if choices else spec.option[2:].replace("-", "_").upper()
            )
            if choices:
                kw["choices"] = [kw["type"](c) if isinstance(c, str) else c for c in choices]
            if spec.kind == "seq":
                kw.update(action="append") if spec.flag.repeat else kw.update(nargs="+")
        where.add_argument(spec.option, *spec.flag.aliases, **kw)


def _choices(hint: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return tuple(hint)
    return None


def _parser(hint: Any) -> Callable[[str], Any]:
    if typing.get_origin(hint) is Literal:
        return type(typing.get_args(hint)[0])
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return functools.partial(_member, hint)
    return hint


def _member(cls: type[enum.Enum], text: str) -> enum.Enum:
    try:
        return cls(text)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {choices})"
        ) from None


def _build(cls: type, args: argparse.Namespace, prefix: str, given: dict[str, Any]) -> Any:
    kwargs = dict(given)
    for spec in _specs(cls):
        if not spec.flag.cli:
            continue
        if spec.kind == "nested":
            kwargs[spec.name] = _build(spec.type, args, f"{prefix}{spec.name}.", {})
            continue
        value = getattr(args, prefix + spec.name)
        kwargs[spec.name] = tuple(value) if spec.kind == "seq" else value
    try:
        return cls(**kwargs)
    except FieldError as exc:
        names = {s.name: s.option for s in _specs(cls) if s.flag.cli and s.kind != "nested"}
        if exc.field not in names:
            raise
        raise FieldError(exc.field, f"{names[exc.field]}: {exc}") from None


def _argv(spec: _Spec, value: Any) -> list[str]:
    if spec.kind == "bool":
        return [spec.option if value else "--no-" + spec.option[2:]]
    if value is None:
        raise ValueError(f"{spec.option} cannot say None (its default is {spec.default()!r})")
    if spec.kind == "seq":
        if not value:
            raise ValueError(
                f"{spec.option} cannot say an empty list (its default is {spec.default()!r})"
            )
        texts = [spec.flag.format(_text(v)) for v in value]
        if spec.flag.repeat:
            return [f"{spec.option}={t}" for t in texts]
        return [spec.option, *texts]
    text = spec.flag.format(_text(value))
    return [f"{spec.option}={text}"] if text.startswith("-") else [spec.option, text]


def _text(value: Any) -> Any:
    """An enum member as its value (what its flag's `type` turns back into the member)."""
    return value.value if isinstance(value, enum.Enum) else value
