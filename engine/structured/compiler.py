"""Compiling a request's constraint against this tokenizer's vocabulary (the backend, xgrammar:
engine/structured/backend.py), cached by content.

Where a compile runs: with a time limit (workers, `pdserve generate`, `LLM`: the default), in
a child process that is killed at the limit (engine/structured/compile_process.py), which
sends the compiled grammar back serialized; without one (limit 0), in the caller's thread.
Either way the grammar a matcher gets is the same (tests/engine/test_grammar_processes.py).

Thread-safe: workers compile on their request threads, never on the engine thread; equal
constraints compile once (cached by content, refusals too; a caller asking for a constraint
another thread is compiling waits for that compile).

Before a compile: a constraint over the size limit, or whose nested counted repetitions
multiply past `max_repetitions` (engine/structured/repetition.py), is refused by name. A cache
miss takes a compile slot first (engine/structured/fair_slots.py: tenants take turns, one
compile each; a slot not free within `wait_s` is `CompileBusy`, RESOURCE_EXHAUSTED on a
worker), so no tenant's pile of compiles starves another's."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from typing import Hashable, NamedTuple, Sequence

import xgrammar as xgr

from engine.checks import FieldError
from engine.processing.tokenizer import Tokenizer
from engine.structured.backend import compile_params, tokenizer_info, xgrammar_compiler
from engine.structured.compile_process import (
    CompileLimits,
    CompileProcesses,
    CompileTimeout,
    timeout_error,
)
from engine.structured.fair_slots import FairSlots
from engine.structured.gate import ReasoningGate
from engine.structured.params import StructuredOutputsParams
from engine.structured.repetition import check_repetitions
from engine.structured.state import GrammarState
from engine.structured.vocab import vocabulary

CACHE_ENTRIES = 1024


class _Refusal(NamedTuple):
    """A constraint that does not compile (or not in time): refused again at once."""

    field: str
    message: str


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Tokenizer | Sequence[bytes],
        vocab_size: int,
        stop_token_ids: frozenset[int],
        limits: CompileLimits = CompileLimits(),
    ) -> None:
        """`tokenizer`: the tokenizer, or its `vocabulary` (engine/structured/vocab.py).
        `vocab_size`: the model's (logit rows), at least the tokenizer's. Special tokens
        other than the stop tokens are never allowed inside a constrained output. `limits`:
        the size and time limits, and the child processes compiles run in."""
        vocab = vocabulary(tokenizer) if isinstance(tokenizer, Tokenizer) else list(tokenizer)
        self._info = tokenizer_info(vocab, vocab_size, stop_token_ids)
        self._limits = limits
        self._processes: CompileProcesses | None = None
        self._compiler: xgr.GrammarCompiler | None = None
        if limits.timeout_s > 0:
            self._processes = CompileProcesses(vocab, vocab_size, stop_token_ids, limits.processes)
            weakref.finalize(self, self._processes.close)  # its children go with it
        else:
            self._compiler = xgrammar_compiler(self._info)
        self._slots = FairSlots(limits.processes, limits.wait_s)
        self._cache: OrderedDict[tuple, xgr.CompiledGrammar | _Refusal] = OrderedDict()
        self._compiling: dict[tuple, Future] = {}
        self._lock = threading.Lock()

    def matcher(
        self, params: StructuredOutputsParams, prompt: Sequence[int] = (), tenant: Hashable = None
    ) -> GrammarState:
        """A fresh matcher for the first output token after `prompt`: at the start of
        `params`' grammar, behind the reasoning gate that `prompt` leaves (gate.py). Raises
        FieldError naming the constraint's field if it does not compile (or not in time, or
        is too large), CompileBusy if no compile slot came free in time."""
        gate = ReasoningGate.for_prompt(params.reasoning_start, params.reasoning_end, prompt)
        return GrammarState(xgr.GrammarMatcher(self.compile(params, tenant)), gate)

    def compile(
        self, params: StructuredOutputsParams, tenant: Hashable = None
    ) -> xgr.CompiledGrammar:
        """`params` compiled (cached by content). Raises FieldError naming its field, or
        CompileBusy (a miss that got no compile slot in time: `tenant`'s turn did not come)."""
        max_bytes = self._limits.max_bytes
        if max_bytes and (size := params.num_bytes()) > max_bytes:
            raise FieldError(
                params.kind,
                f"{params.kind}: the constraint has {size} bytes, more "
                f"than the {max_bytes} this server compiles (--max-grammar-bytes)",
            )
        key = params.key()
        mine: Future | None = None
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
            pending = self._compiling.get(key) if entry is None else None
            if entry is None and pending is None:
                mine = self._compiling[key] = Future()
        if mine is not None:
            entry = self._compile_for_all(key, params, mine, tenant)
        elif entry is None:  # another thread compiles it
            assert pending is not None
            entry = pending.result()
        if isinstance(entry, _Refusal):
            raise FieldError(entry.field, entry.message)
        return entry

    def close(self) -> None:
        """Stops the compile processes (a later compile starts new ones)."""
        if self._processes is not None:
            self._processes.close()

    def _compile_for_all(
        self, key: tuple, params: StructuredOutputsParams, pending: Future, tenant: Hashable
    ) -> xgr.CompiledGrammar | _Refusal:
        """Compile a cache miss in `tenant`'s turn; cache it and hand it to the threads
        waiting on `pending`."""
        try:
            entry: xgr.CompiledGrammar | _Refusal | None = self._too_complex(params)
            if entry is None:
                self._slots.acquire(tenant)
                try:
                    entry = self._compile_miss(params)
                finally:
                    self._slots.release()
        except BaseException as exc:  # not the constraint's fault (busy, no child): not cached
            with self._lock:
                del self._compiling[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._compiling[key]
            self._cache[key] = entry
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        pending.set_result(entry)
        return entry

    def _too_complex(self, params: StructuredOutputsParams) -> _Refusal | None:
        """The repetition limit's refusal (a scan of the constraint: on a miss only)."""
        try:
            check_repetitions(params, self._limits.max_repetitions)
        except FieldError as exc:
            return _Refusal(exc.field, str(exc))
        return None

    def _compile_miss(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar | _Refusal:
        try:
            if self._compiler is not None:
                return compile_params(self._compiler, params)
            assert self._processes is not None
            text = self._processes.compile(params, self._limits.timeout_s)
        except FieldError as exc:
            return _Refusal(exc.field, str(exc))
        except CompileTimeout:
            error = timeout_error(params, self._limits.timeout_s)
            return _Refusal(error.field, str(error))
        return xgr.CompiledGrammar.deserialize_json(text, self._info)
