"""Counted repetitions, measured before any compile: xgrammar expands a counted repetition
`x{m,n}` into copies of `x`, so nested counts multiply — `(((ab|a){0,20}){0,20}){0,20}` is 8000
copies, and 30 bytes of a JSON schema's `pattern` compile for 8 s. A constraint whose
repetition bound (below) is over `--max-grammar-repetitions` is refused by name before it
reaches a compile process (router and workers alike; docs/structured_outputs.md, "Limits").

The bound of a constraint is the largest product of counted-repetition upper bounds along
one nesting path, in any of its regular expressions (a `regex` constraint; each `pattern` and
`patternProperties` key of a JSON schema, a structural tag's schemas and regexes included) or
EBNF grammars (a `grammar` constraint, a structural tag's grammars; a rule referenced inside a
repetition multiplies by that rule's own bound). `{m}` counts m, `{m,n}` counts n, `{m,}`
counts max(m, 1) (its open end is a star). `*`, `+` and `?` count 1: a star is a loop, not
copies (measured: `((ab|a)*){0,100}` in a pattern compiles in 20 ms, `((ab|a){0,100}){0,100}`
in 2.6 s). Sequences do not add up: `a{900}b{900}` is 900 (its size is --max-grammar-bytes').
JSON schema keywords that bound sizes (maxLength, maxItems) are not counted: xgrammar does
not expand them into copies (a 10000-character maxLength compiles in 10 ms).

The scan is linear in the constraint's size and never raises on malformed input (a malformed
constraint is the compiler's to refuse, with its own message)."""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterator

from engine.checks import FieldError
from engine.structured.params import StructuredOutputsParams

_CAP = 1 << 62  # products are clamped here: a bound is compared, never used as a size
_COUNT = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}")
_RULE = re.compile(r"^\s*([A-Za-z_][\w.-]*)\s*::=", re.MULTILINE)
_IDENT = re.compile(r"[A-Za-z_][\w.-]*")


def repetition_bound(params: StructuredOutputsParams) -> int:
    """The largest product of nested counted-repetition bounds in `params` (module
    docstring); 1 without any counted repetition."""
    kind = params.kind
    value = getattr(params, kind)
    if kind == "regex":
        return regex_bound(value)
    if kind == "grammar":
        return ebnf_bound(value)
    if kind in ("json", "structural_tag"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return 1  # not JSON: the compiler refuses it
        return max((_bound_of(k, text) for k, text in _embedded(value)), default=1)
    return 1  # choice, json_object: literals


def check_repetitions(params: StructuredOutputsParams, limit: int) -> None:
    """Raises FieldError naming `params`' field if its repetition bound is over `limit`
    (0: no limit)."""
    if not limit:
        return
    bound = repetition_bound(params)
    if bound > limit:
        shown = f"{bound}" if bound < _CAP else f"more than {_CAP}"
        raise FieldError(
            params.kind,
            f"{params.kind} has nested counted repetitions ({{m,n}}) that multiply to "
            f"{shown} copies, more than the {limit} this server compiles "
            "(--max-grammar-repetitions); use * or + for long runs, or smaller counts",
        )


def regex_bound(pattern: str) -> int:
    """The repetition bound of one regular expression (Python / ECMAScript syntax)."""
    return _scan(pattern, ebnf=False)


def ebnf_bound(grammar: str) -> int:
    """The repetition bound of an EBNF grammar (xgrammar's GBNF): each rule's bound, a
    reference counting as the referenced rule's (a cycle counts 1 at its closing edge)."""
    starts = list(_RULE.finditer(grammar))
    bodies = {
        m.group(1): grammar[m.end() : starts[i + 1].start() if i + 1 < len(starts) else None]
        for i, m in enumerate(starts)
    }
    done: dict[str, int] = {}
    visiting: set[str] = set()

    def rule(name: str) -> int:
        if name in done:
            return done[name]
        if name in visiting or name not in bodies:
            return 1
        visiting.add(name)
        done[name] = _scan(bodies[name], ebnf=True, ref=rule)
        visiting.discard(name)
        return done[name]

    return max((rule(name) for name in bodies), default=1)


def _scan(text: str, ebnf: bool, ref: Callable[[str], int] | None = None) -> int:
    """One pass over `text`: a stack of open groups, each holding the largest bound seen
    inside it; an atom's bound is multiplied by the count that follows it. `ref`: an EBNF
    rule name's bound."""
    stack = [1]  # the largest bound inside each open group (stack[0]: the whole text)
    last: int | None = None  # the bound of the atom a quantifier would apply to
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            last, i = 1, i + 2
        elif ch == "[":
            last, i = 1, _class_end(text, i)
        elif ebnf and ch in "\"'":
            last, i = 1, _string_end(text, i)
        elif ebnf and ch == "#":
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        elif ch == "(":
            stack.append(1)
            last, i = None, i + 1
            continue
        elif ch == ")":
            last = stack.pop() if len(stack) > 1 else 1
            i += 1
        elif ch == "|":
            last, i = None, i + 1
            continue
        elif ch == "{" and (m := _COUNT.match(text, i)):
            low, comma, high = m.group(1), m.group(2), m.group(3)
            count = _int(high) if high else max(_int(low), 1) if comma else _int(low)
            if last is not None:
                last = min(_CAP, last * max(count, 1))
            i = m.end()
        elif ch in "*+?":
            i += 1  # a loop or an option: counts 1
        elif ebnf and ref is not None and (m := _IDENT.match(text, i)):
            last, i = ref(m.group(0)), m.end()
        else:
            last, i = 1, i + 1
        if last is not None and last > stack[-1]:
            stack[-1] = last
    return max(stack)


def _int(digits: str) -> int:
    return int(digits) if len(digits) <= 18 else _CAP  # never a 4300-digit int() (it raises)


def _class_end(text: str, i: int) -> int:
    """The index after the character class that opens at `i` (`]` first is a member)."""
    j = i + 1
    if j < len(text) and text[j] == "^":
        j += 1
    if j < len(text) and text[j] == "]":
        j += 1
    while j < len(text) and text[j] != "]":
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _string_end(text: str, i: int) -> int:
    quote, j = text[i], i + 1
    while j < len(text) and text[j] != quote:
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _bound_of(kind: str, text: str) -> int:
    return ebnf_bound(text) if kind == "grammar" else regex_bound(text)


def _embedded(value: Any) -> Iterator[tuple[str, str]]:
    """("regex" | "grammar", text) of every regular expression and grammar inside a JSON
    schema or structural tag: `pattern` values, `patternProperties` keys, a structural tag's
    `regex` / `grammar` formats."""
    todo = [value]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            for key, item in node.items():
                if key == "pattern" and isinstance(item, str):
                    yield "regex", item
                elif key == "patternProperties" and isinstance(item, dict):
                    yield from (("regex", k) for k in item)
                elif key in ("regex", "grammar") and isinstance(item, str):
                    yield key, item
                todo.append(item)
