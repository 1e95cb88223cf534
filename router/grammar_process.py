"""Compiling structured-output constraints in child processes, so that one which compiles
for too long can be stopped: a thread cannot be killed, a process can. A 60-byte JSON schema
(a pattern of nested counted repetitions) takes xgrammar 10 s; such a compile is killed at
the time limit and its constraint refused.

Each child (spawned, so it shares nothing with the router's threads and event loop) holds a
`GrammarCompiler` over the served vocabulary and compiles one constraint at a time; it is
started on first use (importing xgrammar takes ~2 s; the router itself never imports it) and
replaced after a kill. What a child answers is only whether the constraint compiles — the
router never uses a compiled grammar; the workers compile their own.
"""
from __future__ import annotations

import multiprocessing
import queue
from multiprocessing.connection import Connection
from typing import Sequence

from engine.checks import FieldError
from engine.structured.params import StructuredOutputsParams

_START_TIMEOUT_S = 120.0  # a child's start (imports, vocabulary index): not the client's budget


class CompileTimeout(Exception):
    """The compile did not finish within the time limit (its process was killed)."""


def _serve(conn: Connection, vocab: Sequence[bytes], vocab_size: int,
           stop_token_ids: frozenset[int]) -> None:
    """A child's loop: params in, None (compiles) or (field, message) out."""
    from engine.structured.compiler import GrammarCompiler

    compiler = GrammarCompiler(vocab, vocab_size, stop_token_ids)
    conn.send("ready")
    while True:
        try:
            params = conn.recv()
        except EOFError:
            return
        try:
            compiler.compile(params)
            conn.send(None)
        except FieldError as exc:
            conn.send((exc.field, str(exc)))


class _Child:
    def __init__(self, args: tuple) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(theirs, *args), daemon=True,
                                   name="pdserve-grammar")
        self.process.start()
        theirs.close()
        try:
            ready = self.conn.poll(_START_TIMEOUT_S) and self.conn.recv() == "ready"
        except (EOFError, OSError):  # it died starting
            ready = False
        if not ready:
            self.kill()
            raise RuntimeError("the grammar compile process did not start")

    def compile(self, params: StructuredOutputsParams, timeout_s: float) -> None:
        self.conn.send(params)
        if not self.conn.poll(timeout_s):
            raise CompileTimeout
        answer = self.conn.recv()
        if answer is not None:
            raise FieldError(*answer)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class CompileProcesses:
    """`processes` children compiling constraints, each one at a time; `compile` blocks until
    a child is free (call it from at most `processes` threads). Thread-safe."""

    def __init__(self, vocab: Sequence[bytes], vocab_size: int, stop_token_ids: frozenset[int],
                 processes: int) -> None:
        self._args = (list(vocab), vocab_size, frozenset(stop_token_ids))
        self._free: queue.Queue[_Child | None] = queue.Queue()
        for _ in range(processes):
            self._free.put(None)  # started on first use

    def compile(self, params: StructuredOutputsParams, timeout_s: float) -> None:
        """Returns if `params` compiles within `timeout_s`; raises FieldError (it does not
        compile) or CompileTimeout (killed: its slot starts a fresh child next time)."""
        child = self._free.get()
        try:
            if child is None:
                child = _Child(self._args)
            child.compile(params, timeout_s)
        except CompileTimeout:
            child.kill()
            child = None
            raise
        except (OSError, EOFError):  # the child died compiling it
            if child is not None:
                child.kill()
            child = None
            raise FieldError(params.kind, f"{params.kind} could not be compiled (the "
                             "compiler failed on it)") from None
        finally:
            self._free.put(child)

    def close(self) -> None:
        """Stops the children (a later compile starts new ones)."""
        children = []
        while True:
            try:
                children.append(self._free.get_nowait())
            except queue.Empty:
                break
        for child in children:
            if child is not None:
                child.kill()
            self._free.put(None)
