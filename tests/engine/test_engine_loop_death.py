"""A step that raises kills the engine loop, and nothing that awaits the engine waits
forever: commands queued while it dies and every later call fail with EngineLoopDied."""

import threading
from types import SimpleNamespace

import pytest

from engine.engine_loop import EngineLoop, EngineLoopDied

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning"),
]


class BrokenEngine:
    """Once `broken` is set, the next step waits for `proceed`, then raises."""

    def __init__(self) -> None:
        self.broken, self.stepping, self.proceed = (
            threading.Event(),
            threading.Event(),
            threading.Event(),
        )
        self.scheduler = SimpleNamespace(stats=SimpleNamespace(prompt_tokens=0), running=[])

    def has_schedulable_work(self) -> bool:
        return self.broken.is_set()

    def step(self, inputs=None):
        self.stepping.set()
        self.proceed.wait(5)
        raise IndexError("tuple index out of range")


def test_a_dead_loop_fails_queued_and_later_calls():
    engine = BrokenEngine()
    loop = EngineLoop(engine, lambda deltas: None)
    loop.start()
    try:
        assert loop.call(lambda e: 41 + 1).result(5) == 42
        engine.broken.set()
        loop.call(lambda e: None).result(5)  # wakes the loop: it steps next
        assert engine.stepping.wait(5)
        queued = [loop.call(lambda e: "never") for _ in range(3)]  # while the step runs
        engine.proceed.set()
        for future in queued:
            with pytest.raises(EngineLoopDied, match="tuple index out of range"):
                future.result(5)  # answered, not stranded
        assert not loop.alive
        with pytest.raises(EngineLoopDied, match="tuple index out of range"):
            loop.call(lambda e: "after").result(0)  # failed at once
    finally:
        loop.stop()
