"""Drives an LLMEngine on a thread of its own, so network I/O never stalls a step and a step
never stalls I/O.

Other threads never touch the engine's state: they `call(fn)` to run `fn(engine)` on the loop
thread between steps and get a concurrent Future. (Only `engine.make_request` and
`engine.limits` are safe to use directly from another thread; they read no mutable state.) Deltas of every step go to `on_deltas` (on the loop
thread; workers forward them to asyncio with call_soon_threadsafe). `after_step(engine)` runs
after every step and while idle; it returns True while it has work in flight (e.g. KV
transfers to poll), which keeps the loop polling with a short sleep instead of waiting for a
command."""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, TypeVar

from engine.llm_engine import LLMEngine
from engine.outputs import CompletionDelta

log = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_WAIT_S = 0.5  # nothing to do: wake at least this often
POLL_WAIT_S = 0.001  # work in flight elsewhere (transfers): poll this often


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_deltas: Callable[[list[CompletionDelta]], None],
        after_step: Callable[[LLMEngine], bool] | None = None,
    ) -> None:
        self.engine = engine
        self._on_deltas = on_deltas
        self._after_step = after_step
        self._commands: queue.SimpleQueue[tuple[Callable, Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.step_seconds = 0.0  # wall time inside engine.step(), cumulative
        self.prefill_seconds = 0.0  # share of it in steps that computed prompt tokens

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """False once the loop thread has died (a step raised): the process should exit."""
        return self._thread.is_alive()

    def call(self, fn: Callable[[LLMEngine], T]) -> "Future[T]":
        """Run `fn(engine)` on the loop thread before its next step."""
        future: Future = Future()
        self._commands.put((fn, future))
        self._wake.set()
        return future

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:  # handed to the caller, never kills the loop
                future.set_exception(exc)

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._wake.clear()
            self._run_commands()
            stepped = False
            if engine.has_schedulable_work():
                prompt_before = engine.scheduler.stats.prompt_tokens
                t0 = time.perf_counter()
                try:
                    deltas = engine.step()
                except Exception:  # a bug in a step must not leave clients hanging silently
                    log.exception("engine step failed")
                    raise
                dt = time.perf_counter() - t0
                self.step_seconds += dt
                if engine.scheduler.stats.prompt_tokens != prompt_before:
                    self.prefill_seconds += dt
                stepped = True
                if deltas:
                    self._on_deltas(deltas)
            in_flight = self._after_step(engine) if self._after_step else False
            if not stepped:
                self._wake.wait(POLL_WAIT_S if in_flight else IDLE_WAIT_S)
