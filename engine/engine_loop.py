"""Drives an LLMEngine on a thread of its own, so network I/O never stalls a step and a step
never stalls I/O.

Other threads never touch the engine's state: they `call(fn)` to run `fn(engine)` on the loop
thread between steps and get a concurrent Future. (Only `engine.make_request` and
`engine.limits` are safe to use directly from another thread; they read no mutable state.) Deltas of
every step go to `on_deltas` (on the loop thread; workers forward them to asyncio with
call_soon_threadsafe). `after_step(engine)` runs after every step and while idle; it returns True
while it has work in flight (e.g. KV transfers to poll), which keeps the loop polling with a short
sleep instead of waiting for a command.

Step timings: every step's wall time is folded into exponentially weighted means over recent
steps, one set for steps that computed prompt tokens and one for steps that did not
(`StepTimings`); workers publish them so the router can estimate how soon each worker would
answer a prompt (router/placement/estimates.py). With an inter-token latency target, the same
timings size the prefill chunks that run beside decodes (`prompt_cap`, engine/core/step_cost.py),
so a decode worker prefilling a long prompt itself keeps its decodes flowing.

A step that raises kills the loop (a bug must not be stepped over): every command queued
then, and every later `call`, fails with `EngineLoopDied`, so nothing awaiting the engine
waits forever, and the worker process exits for its supervisor to restart it."""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Protocol, TypeVar

from engine.core.scheduler_output import StepInput
from engine.core.step_cost import fitted_slope, prompt_token_cap, step_cost_from
from engine.llm_engine import LLMEngine
from engine.processing.outputs import CompletionDelta

log = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_WAIT_S = 0.5  # nothing to do: wake at least this often
POLL_WAIT_S = 0.001  # work in flight elsewhere (transfers): poll this often
INITIAL_PROMPT_CAP_BLOCKS = 4  # prefill chunk beside decodes before step costs are measured
STEP_EWMA_WEIGHT = 0.1  # weight of the newest step in the step-timing means (~ the last 10-20)


class StepThreads(Protocol):
    """Sizes each step's intra-op threads (worker_runtime/host_cores.py: workers on one host
    lend each other their idle cores)."""

    def begin_step(self) -> int:
        """A step is about to run: apply and return its thread count."""

    def end_busy(self) -> None:
        """The engine has no work until the next `begin_step`."""


class EngineLoopDied(RuntimeError):
    """The loop thread has died (a step raised); no command runs any more."""


@dataclass(frozen=True, slots=True)
class StepTimings:
    """Exponentially weighted means over recent steps of one kind. Immutable: the loop
    thread swaps in a new one after each step, so another thread reading it sees one
    consistent set. The first step of each kind is left out (warm-up: first forwards
    allocate and tune); `steps` counts the rest."""

    seconds: float = 0.0
    """Wall time of one step."""
    tokens: float = 0.0
    """Tokens computed in one step: prompt tokens + one per decoding request."""
    prompt_tokens: float = 0.0
    """Of which prompt tokens."""
    steps: int = 0
    warm: bool = False

    def added(self, seconds: float, tokens: int, prompt_tokens: int) -> "StepTimings":
        """These means with one more step folded in."""
        if not self.warm:
            return StepTimings(warm=True)
        w = STEP_EWMA_WEIGHT if self.steps else 1.0
        return StepTimings(
            self.seconds + w * (seconds - self.seconds),
            self.tokens + w * (tokens - self.tokens),
            self.prompt_tokens + w * (prompt_tokens - self.prompt_tokens),
            self.steps + 1,
            True,
        )

    @property
    def prompt_tokens_per_s(self) -> float:
        """Prompt tokens computed per second of these steps (0 until measured)."""
        return self.prompt_tokens / self.seconds if self.seconds > 0 else 0.0


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_deltas: Callable[[list[CompletionDelta]], None],
        after_step: Callable[[LLMEngine], bool] | None = None,
        itl_target_s: float = 0.0,
        step_threads: StepThreads | None = None,
        in_flight_wait_s: float = POLL_WAIT_S,
    ) -> None:
        self.engine = engine
        self.in_flight_wait_s = in_flight_wait_s
        """Idle with work in flight elsewhere (transfers: `after_step` said so): look again
        this often. A caller whose transfers `wake` the loop when they end waits longer."""
        self.step_threads = step_threads
        self.itl_target_s = itl_target_s
        """> 0: while requests decode, prefill chunks are sized so a step's measured cost
        stays within this (their inter-token latency); `prompt_cap` is that size."""
        self.prompt_cap = 0
        self._on_deltas = on_deltas
        self._after_step = after_step
        self._commands: queue.SimpleQueue[tuple[Callable, Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._death: BaseException | None = None  # what killed the loop thread
        self._death_lock = threading.Lock()  # a command is queued before, or refused after
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.step_seconds = 0.0  # wall time inside engine.step(), cumulative
        self.prefill_seconds = 0.0  # share of it in steps that computed prompt tokens
        self.prefill_steps = StepTimings()  # recent steps that computed prompt tokens
        self.decode_steps = StepTimings()  # recent steps that computed none

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def wake(self) -> None:
        """Run the after-step work now if the loop is waiting (any thread): something it
        waits for (a transfer result) arrived."""
        self._wake.set()

    @property
    def alive(self) -> bool:
        """False once the loop thread has died (a step raised): the process should exit."""
        return self._thread.is_alive() and self._death is None

    def call(self, fn: Callable[[LLMEngine], T]) -> "Future[T]":
        """Run `fn(engine)` on the loop thread before its next step; once the loop has died,
        the future fails with EngineLoopDied."""
        future: Future = Future()
        with self._death_lock:
            if self._death is None:
                self._commands.put((fn, future))
                self._wake.set()
                return future
        future.set_exception(self._died())
        return future

    def _died(self) -> EngineLoopDied:
        return EngineLoopDied(f"the engine loop died: {self._death!r}")

    def _fail_commands(self, exc: BaseException) -> None:
        with self._death_lock:
            self._death = exc
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(self._died())

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
        try:
            self._loop()
        except BaseException as exc:
            self._fail_commands(exc)
            raise

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._wake.clear()
            self._run_commands()
            stepped = False
            if engine.has_schedulable_work():
                prompt_before = engine.scheduler.stats.prompt_tokens
                decoding = _num_decoding(engine)
                step = StepInput()
                if self.itl_target_s > 0:
                    self.prompt_cap = self._prompt_cap(
                        max(decoding, 1), len(engine.scheduler.waiting)
                    )
                    step = StepInput(prompt_token_budget=self.prompt_cap if decoding else 0)
                if self.step_threads is not None:
                    self.step_threads.begin_step()
                t0 = time.perf_counter()
                try:
                    deltas = engine.step(step)
                except Exception:  # a bug in a step must not leave clients hanging silently
                    log.exception("engine step failed")
                    raise
                dt = time.perf_counter() - t0
                self.step_seconds += dt
                prompt = engine.scheduler.stats.prompt_tokens - prompt_before
                if prompt:
                    self.prefill_seconds += dt
                    self.prefill_steps = self.prefill_steps.added(dt, prompt + decoding, prompt)
                elif decoding:
                    self.decode_steps = self.decode_steps.added(dt, decoding, 0)
                stepped = True
                if deltas:
                    self._on_deltas(deltas)
            in_flight = self._after_step(engine) if self._after_step else False
            if not stepped:
                if self.step_threads is not None:
                    self.step_threads.end_busy()
                self._wake.wait(self.in_flight_wait_s if in_flight else IDLE_WAIT_S)

    def _prompt_cap(self, decoding: int, queued: int = 0) -> int:
        """Prompt tokens per step that keep a step beside `decoding` decodes within the ITL
        target (or, with `queued` prompts waiting, keep prefill ahead of them:
        `prompt_token_cap`), from this loop's measured step costs; before they can be
        fitted, the measured prefill rate, and before anything is measured,
        `INITIAL_PROMPT_CAP_BLOCKS`."""
        engine, d, p = self.engine, self.decode_steps, self.prefill_steps
        timings = (d.seconds, d.tokens, p.seconds, p.tokens)
        per_token = fitted_slope(*timings)
        if per_token is None and p.prompt_tokens_per_s > 0:
            per_token = 1.0 / p.prompt_tokens_per_s  # mixed steps: errs towards smaller chunks
        block_size = engine.config.block_size
        if per_token is None:
            return INITIAL_PROMPT_CAP_BLOCKS * block_size
        cost = step_cost_from(*timings, per_token)
        return prompt_token_cap(
            cost,
            decoding,
            self.itl_target_s,
            block_size,
            engine.config.max_num_batched_tokens,
            queued,
        )


def _num_decoding(engine: LLMEngine) -> int:
    """Running requests past their prompt: one decode token each in the next step."""
    return sum(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running)
