"""Compiling structured-output constraints in child processes, so that one which compiles for
too long can be stopped: a thread cannot be killed, a process can. A 60-byte JSON schema (a
pattern of nested counted repetitions) takes xgrammar 10 s; such a compile is killed at the
time limit and its constraint refused. The router checks constraints here (`check`: compiles
or not); the workers compile theirs here (`compile`: the compiled grammar, serialized, which
`GrammarCompiler` rebuilds against its own vocabulary index).

Each child (a fresh interpreter, so it shares nothing with its parent's threads, event loop or
CUDA) holds an xgrammar compiler over the served vocabulary and compiles one constraint at a
time; what crosses the socket between them is JSON (and the vocabulary's bytes), never pickle.
It is started on first use (importing xgrammar takes seconds; this module imports neither
xgrammar nor torch, so the router stays free of both) and replaced after a kill.

Life cycle of a child: started on a slot's first use -> "ready" -> one (params, want grammar)
at a time -> killed at the time limit (its slot starts a fresh one next time), or stopped by
`close`, or it exits when its parent's end of the socket closes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import socket
import subprocess
import sys
import time
from array import array
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Sequence

from engine.checks import FieldError
from engine.structured.params import StructuredOutputsParams

_START_TIMEOUT_S = 120.0  # a child's start (imports, vocabulary index): not the client's budget


@dataclass(frozen=True)
class CompileLimits:
    """What a process compiles, and how: the fields of the same name in EngineConfig (workers)
    and the router's LimitsConfig."""

    timeout_s: float = 10.0
    """A constraint that does not compile within this many seconds is refused (its child is
    killed); 0: compile in the caller's thread, without a limit."""
    processes: int = 1
    """Child processes compiling constraints, each one at a time."""
    max_bytes: int = 128 << 10
    """Largest constraint (`StructuredOutputsParams.num_bytes`); 0: no limit."""
    max_repetitions: int = 1000
    """Largest product of nested counted-repetition bounds (engine/structured/repetition.py),
    refused before any compile; 0: no limit."""
    wait_s: float = 10.0
    """The longest a compile waits for a free process (engine/structured/fair_slots.py:
    tenants take turns); past it the request is refused as busy (`CompileBusy`)."""


class CompileTimeout(Exception):
    """The compile did not finish within the time limit (its process was killed)."""


def timeout_error(params: StructuredOutputsParams, timeout_s: float) -> FieldError:
    """The refusal of a constraint that did not compile in time, naming its field."""
    return FieldError(
        params.kind,
        f"{params.kind} did not compile within {timeout_s:g} s (the "
        "server's --grammar-compile-timeout); simplify it",
    )


def _serve(conn: Connection) -> None:
    """A child's loop: the vocabulary first, then (params, want grammar) in; {"ok": serialized
    grammar or None} or {"refused": [field, message]} out. JSON frames, never pickle."""
    from engine.structured.backend import compile_params, tokenizer_info, xgrammar_compiler

    header = json.loads(conn.recv_bytes())
    compiler = xgrammar_compiler(
        tokenizer_info(
            _unpack(conn.recv_bytes()), header["vocab_size"], frozenset(header["stop_token_ids"])
        )
    )
    conn.send_bytes(b'"ready"')
    while True:
        try:
            ask = json.loads(conn.recv_bytes())
        except EOFError:  # the parent closed its end, or exited
            return
        params = StructuredOutputsParams(**ask["params"])
        try:
            compiled = compile_params(compiler, params)
        except FieldError as exc:
            conn.send_bytes(json.dumps({"refused": [exc.field, str(exc)]}).encode())
            continue
        text = compiled.serialize_json() if ask["grammar"] else None
        conn.send_bytes(json.dumps({"ok": text}).encode())


def _pack(vocab: Sequence[bytes]) -> bytes:
    lengths = array("I", map(len, vocab))
    return len(vocab).to_bytes(4, "little") + lengths.tobytes() + b"".join(vocab)


def _unpack(blob: bytes) -> list[bytes]:
    n = int.from_bytes(blob[:4], "little")
    lengths = array("I")
    lengths.frombytes(blob[4 : 4 + 4 * n])
    out, at = [], 4 + 4 * n
    for length in lengths:
        out.append(blob[at : at + length])
        at += length
    return out


class _Child:
    """One compile process: `python -m engine.structured.compile_process FD`, a socket pair
    between them (a fresh interpreter: nothing of the parent's `__main__` is re-run, as
    multiprocessing's spawn would)."""

    def __init__(self, header: bytes, vocab: bytes) -> None:
        mine, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine.structured.compile_process", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = Connection(mine.detach())
        try:
            self.conn.send_bytes(header)
            self.conn.send_bytes(vocab)
            ready = self.conn.poll(_START_TIMEOUT_S) and self.conn.recv_bytes() == b'"ready"'
        except (EOFError, OSError):  # it died starting
            ready = False
        if not ready:
            self.kill()
            raise RuntimeError("the grammar compile process did not start")

    def compile(
        self, params: StructuredOutputsParams, want_grammar: bool, timeout_s: float
    ) -> str | None:
        self.conn.send_bytes(
            json.dumps({"params": dataclasses.asdict(params), "grammar": want_grammar}).encode()
        )
        if not self.conn.poll(timeout_s):
            raise CompileTimeout
        answer = json.loads(self.conn.recv_bytes())
        if "refused" in answer:
            raise FieldError(*answer["refused"])
        return answer["ok"]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(5)
        self.conn.close()


class CompileProcesses:
    """`processes` children compiling constraints against one vocabulary, each one at a time;
    a call blocks until a child is free (waiting does not count against the time limit).
    Thread-safe."""

    def __init__(
        self,
        vocab: Sequence[bytes],
        vocab_size: int,
        stop_token_ids: frozenset[int],
        processes: int,
    ) -> None:
        """`vocab`: each token id's bytes (engine/structured/vocab.py `vocabulary`);
        `vocab_size`: the model's (logit rows), at least len(vocab)."""
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self._header = json.dumps(
            {"vocab_size": vocab_size, "stop_token_ids": sorted(stop_token_ids)}
        ).encode()
        self._vocab = _pack(vocab)
        self._free: queue.Queue[_Child | None] = queue.Queue()
        for _ in range(processes):
            self._free.put(None)  # started on first use

    def check(
        self, params: StructuredOutputsParams, timeout_s: float, spent: list[float] | None = None
    ) -> None:
        """Returns if `params` compiles within `timeout_s`; raises FieldError (it does not
        compile) or CompileTimeout (killed: its slot starts a fresh child next time). Either
        way `spent[0]`, if given, is set to the seconds the compile took (a child's start not
        counted: the server's cost, not the constraint's)."""
        self._run(params, False, timeout_s, spent)

    def compile(self, params: StructuredOutputsParams, timeout_s: float) -> str:
        """`params` compiled within `timeout_s`, as xgrammar's `CompiledGrammar.serialize_json`
        (rebuilt with `deserialize_json` against a TokenizerInfo of the same vocabulary).
        Raises as `check`."""
        text = self._run(params, True, timeout_s)
        assert text is not None
        return text

    def _run(
        self,
        params: StructuredOutputsParams,
        want_grammar: bool,
        timeout_s: float,
        spent: list[float] | None = None,
    ) -> str | None:
        child = self._free.get()
        try:
            if child is None:
                child = _Child(self._header, self._vocab)
            t0 = time.monotonic()
            try:
                return child.compile(params, want_grammar, timeout_s)
            finally:
                if spent is not None:
                    spent[0] = time.monotonic() - t0
        except CompileTimeout:
            assert child is not None  # only its compile times out
            child.kill()
            child = None
            raise
        except (OSError, EOFError):  # the child died compiling it
            if child is not None:
                child.kill()
            child = None
            raise FieldError(
                params.kind, f"{params.kind} could not be compiled (the compiler failed on it)"
            ) from None
        finally:
            self._free.put(child)

    def close(self) -> None:
        """Stops the idle children (a later compile starts new ones); a child busy compiling
        is left to its caller."""
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


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
