"""Structured outputs at the router: the request's constraint, from whichever field the
client used — OpenAI's `response_format`, vLLM's `structured_outputs`, or vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` / `structural_tag` — as
one engine `StructuredOutputsParams`, checked by compiling it against the served vocabulary
before any worker is tied up (`Grammars.check`: in a child process, off the event loop, with
a time limit; a compile takes milliseconds to seconds, a pathological one minutes). A
constraint over the size limit, or whose nested counted repetitions multiply past
--max-grammar-repetitions (engine/structured/repetition.py), is refused before any compile.
Every refusal is a 400 naming the field the client used.

Compiles are shared fairly: API keys take turns at the compile processes (one compile each,
engine/structured/fair_slots.py; keyless requests are one tenant), a request that gets no
compile process within --grammar-compile-wait is a 503 with Retry-After, and the seconds a
compile took are charged to its key (router/http/key_limits.py: `charge_compile`, throttled
by --max-compile-seconds-per-minute-per-key).

`structured_outputs` may also carry only flags (`disable_any_whitespace`, ...) beside a
constraint given another way; two constraints are refused, as vLLM refuses them."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

from engine.checks import FieldError
from engine.processing.tokenizer import Tokenizer
from engine.structured.compile_process import (
    CompileProcesses,
    CompileTimeout,
    timeout_error,
)
from engine.structured.fair_slots import CompileBusy, FairSlots
from engine.structured.params import KINDS, StructuredOutputsParams
from engine.structured.repetition import check_repetitions
from router.endpoints.chat.protocol import ChatCompletionRequest
from router.endpoints.completions.protocol import CompletionRequest
from router.endpoints.sampling import ResponseFormat
from router.http.errors import APIError, bad_request
from router.http.key_limits import KEYLESS, KeyLimits

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "structural_tag": "structural_tag",
}
_BACKENDS = ("xgrammar", "auto")
CACHE_ENTRIES = 4096  # compile results remembered (constraint key -> refusal or None)
# vLLM's backend options ("xgrammar:no-fallback,disable-any-whitespace") -> flags.
_BACKEND_OPTIONS = {
    "no-fallback": "disable_fallback",
    "disable-any-whitespace": "disable_any_whitespace",
    "disable-additional-properties": "disable_additional_properties",
}


@dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams
    param: str
    """The request field the constraint came from: a 400 about it names this field."""


def constraint(
    req: ChatCompletionRequest | CompletionRequest, max_bytes: int | None = None
) -> Constraint | None:
    """The request's structured-output constraint (None: unconstrained). Raises a 400
    APIError for two constraints, an unknown backend, a whitespace pattern, a constraint
    larger than `max_bytes` (`StructuredOutputsParams.num_bytes`), or a malformed constraint
    (compiling it is
    `Grammars.check`)."""
    found: list[tuple[str, dict[str, Any]]] = []  # (request field, StructuredOutputsParams kwargs)
    flags: dict[str, Any] = {}  # StructuredOutputsParams' flags (bool) and backend options
    if req.response_format is not None and req.response_format.type != "text":
        found.append(("response_format", _response_format(req.response_format)))
    so = req.structured_outputs
    if so is not None:
        if so.whitespace_pattern is not None:
            raise _no_whitespace_pattern("structured_outputs")
        given = {
            k: v
            for k, v in (
                ("json", so.json_),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
                ("json_object", so.json_object),
                ("structural_tag", so.structural_tag),
            )
            if v not in (None, False)
        }
        if given:
            found.append(("structured_outputs", given))
        flags = {
            k: True
            for k in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
            if getattr(so, k)
        }
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, {kind: value}))
    if req.guided_whitespace_pattern is not None:
        raise _no_whitespace_pattern("guided_whitespace_pattern")
    if req.guided_decoding_backend is not None:
        flags.update(_backend(req.guided_decoding_backend))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_request(
            f"only one structured-output constraint is allowed per request; got {names}",
            found[1][0],
        )
    if not found:
        if so is not None:
            raise bad_request(
                f"structured_outputs needs one of {', '.join(KINDS)}", "structured_outputs"
            )
        return None
    param, kwargs = found[0]
    try:
        params = StructuredOutputsParams(**kwargs, **flags)
    except FieldError as exc:
        raise _invalid(exc, param) from None
    if max_bytes is not None and (size := params.num_bytes()) > max_bytes:
        raise bad_request(
            f"{param}: the {params.kind} constraint has {size} bytes, more than "
            f"the {max_bytes} this server compiles (--max-grammar-bytes)",
            param,
            "grammar_too_large",
        )
    return Constraint(params, param)


_SCAN_ON_LOOP_BYTES = 4 << 10  # larger constraints are scanned for repetitions off the loop


class _Refusal(NamedTuple):
    message: str
    code: str | None  # the 400's code (grammar_too_complex), or none


class Grammars:
    """Checks that constraints compile against the served vocabulary, as the workers will: a
    constraint that does not compile is refused here, before placement. Compiles run in
    `processes` child processes (engine/structured/compile_process.py, the workers' too), each
    bounded by `timeout_s` (killed past it: a 400), and awaited on their own threads, never on
    the event loop. Results are cached by content, refusals too: a constraint refused once is
    refused at once, one compiled once is never compiled again (and never waits).

    Life cycle of a check: the cache -> the repetition bound (a 400 `grammar_too_complex`,
    cached) -> the key's compile-seconds bucket (`key_limits.may_compile`: a 429) -> a compile
    slot in the key's turn, awaited on the event loop up to `wait_s` (a 503 `compile_busy`,
    Retry-After) -> the compile, on an executor thread that gives the slot back when the
    compile ends (even if the client left) -> its seconds charged to the key
    (`key_limits.charge_compile`)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        processes: int = 1,
        timeout_s: float = 10.0,
        wait_s: float = 10.0,
        max_repetitions: int = 1000,
        key_limits: KeyLimits | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._processes = processes
        self._timeout_s = timeout_s
        self._max_repetitions = max_repetitions
        self._key_limits = key_limits
        self.slots = FairSlots(processes, wait_s)
        """The compile slots (one per process), shared by keys in turns."""
        self._pool: CompileProcesses | None = None
        self._lock = threading.Lock()
        self._results: OrderedDict[tuple, _Refusal | None] = OrderedDict()  # key -> refusal
        # One thread per slot: a thread only ever runs a compile that holds a slot.
        self._executor = ThreadPoolExecutor(processes, thread_name_prefix="grammar")

    async def check(self, c: Constraint, tenant: bytes | None = None) -> None:
        """Raises the 400 APIError naming `c.param` if `c` is too complex or does not
        compile in time, a 429 if `tenant` (an inference key's digest; None: keyless) has
        spent its compile seconds, a 503 if no compile slot came free in its turn."""
        key = c.params.key()
        with self._lock:
            known = key in self._results
            refusal = self._results.get(key)
        if not known:
            refusal = await self._too_complex(c.params, key)
            if refusal is None:
                refusal = await self._compile_in_turn(c.params, key, tenant)
        if refusal is not None:
            raise _invalid(FieldError(c.params.kind, refusal.message), c.param, refusal.code)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()

    async def _too_complex(self, params: StructuredOutputsParams, key: tuple) -> _Refusal | None:
        """The repetition limit's refusal (cached), or None. The scan is linear but in Python
        (~5 ms for a dense 16 KiB regex): a large constraint is scanned off the event loop."""
        try:
            if params.num_bytes() > _SCAN_ON_LOOP_BYTES:
                await asyncio.to_thread(check_repetitions, params, self._max_repetitions)
            else:
                check_repetitions(params, self._max_repetitions)
        except FieldError as exc:
            refusal = _Refusal(str(exc), "grammar_too_complex")
            self._remember(key, refusal)
            return refusal
        return None

    def _remember(self, key: tuple, refusal: _Refusal | None) -> None:
        with self._lock:
            self._results[key] = refusal
            while len(self._results) > CACHE_ENTRIES:
                self._results.popitem(last=False)

    async def _compile_in_turn(
        self, params: StructuredOutputsParams, key: tuple, tenant: bytes | None
    ) -> _Refusal | None:
        if self._key_limits is not None:
            self._key_limits.may_compile(tenant)
        try:
            await self.slots.acquire_async(KEYLESS if tenant is None else tenant)
        except CompileBusy as exc:
            raise APIError(
                503,
                str(exc),
                code="compile_busy",
                headers={"Retry-After": str(max(1, math.ceil(self._timeout_s)))},
            ) from None
        done = asyncio.get_running_loop().run_in_executor(
            self._executor, self._compile_in_slot, params, key
        )
        limits = self._key_limits
        if limits is not None:  # charged when the compile ends, whether the client waits or not

            def charge(f: asyncio.Future[tuple[_Refusal | None, float]]) -> None:
                if not f.cancelled() and f.exception() is None:
                    limits.charge_compile(tenant, f.result()[1])

            done.add_done_callback(charge)
        refusal, _ = await asyncio.shield(done)
        return refusal

    def _compile_in_slot(
        self, params: StructuredOutputsParams, key: tuple
    ) -> tuple[_Refusal | None, float]:
        """(refusal or None, seconds compiling) for `params`, in the slot its caller holds
        (given back here, when the compile ends). A constraint another request compiled while
        this one waited is not compiled again."""
        try:
            with self._lock:
                if key in self._results:
                    return self._results[key], 0.0
            spent = [0.0]
            message = self._compile(params, spent)
            refusal = None if message is None else _Refusal(message, None)
            self._remember(key, refusal)
            return refusal, spent[0]
        finally:
            self.slots.release()

    def _compile(self, params: StructuredOutputsParams, spent: list[float]) -> str | None:
        """None if `params` compiles within the time limit, else why not. `spent[0]`: the
        seconds it compiled (a killed compile: the whole limit)."""
        try:
            self._get().check(params, self._timeout_s, spent)
        except FieldError as exc:
            return str(exc)
        except CompileTimeout:
            spent[0] = max(spent[0], self._timeout_s)
            return str(timeout_error(params, self._timeout_s))
        return None

    def _get(self) -> CompileProcesses:
        with self._lock:
            if self._pool is None:
                from engine.structured.vocab import vocabulary

                tok = self._tokenizer
                self._pool = CompileProcesses(
                    vocabulary(tok),
                    max(self._vocab_size, tok.vocab_size),
                    tok.stop_token_ids,
                    self._processes,
                )
            return self._pool


def _response_format(rf: ResponseFormat) -> dict[str, Any]:
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request(
                "response_format of type json_schema needs json_schema.schema", "response_format"
            )
        return {"json": rf.json_schema.schema_}
    # structural_tag: xgrammar's format, or vLLM's older structures + triggers in it.
    if rf.format is not None:
        return {"structural_tag": json.dumps({"type": "structural_tag", "format": rf.format})}
    if rf.structures is None or rf.triggers is None:
        raise bad_request(
            "response_format of type structural_tag needs format (or structures and triggers)",
            "response_format",
        )
    tags = [
        {
            "type": "tag",
            "begin": s.begin,
            "end": s.end,
            "content": {"type": "json_schema", "json_schema": s.schema_ or {}},
        }
        for s in rf.structures
    ]
    return {
        "structural_tag": json.dumps(
            {
                "type": "structural_tag",
                "format": {"type": "triggered_tags", "triggers": rf.triggers, "tags": tags},
            }
        )
    }


def _backend(value: str) -> dict[str, bool]:
    name, _, options = value.partition(":")
    if name not in _BACKENDS:
        raise bad_request(
            f"guided_decoding_backend {name!r} is not available: this server "
            f"compiles constraints with xgrammar (use 'xgrammar' or 'auto')",
            "guided_decoding_backend",
        )
    flags = {}
    for option in filter(None, options.split(",")):
        if option not in _BACKEND_OPTIONS:
            raise bad_request(
                f"guided_decoding_backend option {option!r} is not known (known: "
                f"{', '.join(_BACKEND_OPTIONS)})",
                "guided_decoding_backend",
            )
        flags[_BACKEND_OPTIONS[option]] = True
    return flags


def _invalid(exc: FieldError, param: str, code: str | None = None):
    message = str(exc)
    return bad_request(message if message.startswith(param) else f"{param}: {message}", param, code)


def _no_whitespace_pattern(param: str):
    return bad_request(
        f"{param}: a whitespace pattern cannot be honoured: xgrammar, this "
        "server's grammar backend, has no whitespace pattern (for JSON without "
        "optional whitespace use structured_outputs.disable_any_whitespace)",
        param,
    )
