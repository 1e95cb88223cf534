"""The role gate and the SetRole state machine (worker_runtime/roles.py) on a fake runtime:
which calls are admitted in which state, what a switch publishes, drains, aborts and moves,
and what it refuses (unknown role, sleeping, shutting down, a drain that cannot end)."""
import asyncio
from types import SimpleNamespace

import pytest

from worker_runtime import roles as roles_module
from worker_runtime.grpc_errors import FailedPrecondition, Unavailable
from worker_runtime.roles import WorkerRoles

pytestmark = pytest.mark.timeout(30)


class FakeRuntime:
    """What WorkerRoles touches of a WorkerRuntime; records what it was asked to do."""

    def __init__(self, role: str = "prefill", drain_timeout_s: float = 5.0) -> None:
        self.config = SimpleNamespace(drain_timeout_s=drain_timeout_s)
        self.lifecycle = SimpleNamespace(lock=asyncio.Lock(), sleeping=False)
        self.draining = False
        self.paused = None
        self.inflight = 0
        self.streams: dict[str, object] = {}
        self.events: list[tuple] = []
        self.abort_ends_calls = True  # an aborted call ends (its in-flight count drops)
        self.metrics = SimpleNamespace(set_role=lambda role, previous: self.events.append(
            ("metrics", previous, role)))
        self.registrar = SimpleNamespace(move=self._move)
        self.roles = WorkerRoles(self, role)

    async def _move(self, old_role: str) -> None:
        self.events.append(("move", old_role, self.roles.role))

    async def republish(self) -> None:
        self.events.append(("publish", self.roles.role, self.roles.switching))

    async def call(self, fn, cancellable: bool = True):
        engine = SimpleNamespace(scheduler=SimpleNamespace(running=[], waiting=[], waiting_for_kv=[]))
        return fn(engine)

    async def abort(self, request_id: str) -> bool:
        self.events.append(("abort", request_id))
        if self.abort_ends_calls:
            self.streams.pop(request_id)
            self.inflight -= 1
        return True


def run(coro):
    return asyncio.run(coro)


def test_the_gate_admits_only_the_role_served_now():
    rt = FakeRuntime("prefill")
    rt.roles.admit("prefill")
    with pytest.raises(FailedPrecondition, match="serves the prefill role, not decode"):
        rt.roles.admit("decode")
    rt.roles.switching_to = "decode"
    for role in ("prefill", "decode"):
        with pytest.raises(Unavailable, match="switching from the prefill role to the decode"):
            rt.roles.admit(role)


def test_same_role_is_a_no_op_and_bad_arguments_are_refused():
    async def main():
        rt = FakeRuntime("decode")
        assert await rt.roles.set_role("decode") == "decode"
        assert rt.events == [] and rt.roles.role == "decode"
        with pytest.raises(ValueError, match="role must be one of prefill, decode"):
            await rt.roles.set_role("both")
        with pytest.raises(ValueError, match="drain_timeout_s"):
            await rt.roles.set_role("prefill", -1.0)
        with pytest.raises(ValueError, match="drain_timeout_s"):
            await rt.roles.set_role("prefill", float("nan"))
        assert rt.roles.role == "decode" and not rt.roles.switching

    run(main())


@pytest.mark.parametrize("state, message", [
    ("sleeping", "sleeping: wake it up"), ("paused", "going to sleep"), ("draining", "shutting down")])
def test_a_switch_is_refused_while_sleeping_pausing_or_shutting_down(state, message):
    async def main():
        rt = FakeRuntime("prefill")
        if state == "sleeping":
            rt.lifecycle.sleeping = True
        elif state == "paused":
            rt.paused = "going to sleep"
        else:
            rt.draining = True
        with pytest.raises(FailedPrecondition, match=message):
            await rt.roles.set_role("decode")
        assert rt.roles.role == "prefill" and not rt.roles.switching and rt.events == []

    run(main())


def test_a_switch_publishes_draining_waits_for_in_flight_calls_then_moves():
    async def main():
        rt = FakeRuntime("prefill")
        rt.inflight = 1
        switch = asyncio.create_task(rt.roles.set_role("decode"))
        await asyncio.sleep(0.1)
        assert not switch.done() and rt.roles.switching
        assert rt.events == [("publish", "prefill", True)]  # draining, under the old role
        with pytest.raises(Unavailable):
            rt.roles.admit("prefill")
        rt.inflight = 0  # the last Prefill call returned
        assert await switch == "prefill"
        assert rt.roles.role == "decode" and not rt.roles.switching
        assert rt.events[1:] == [("metrics", "prefill", "decode"), ("move", "prefill", "decode")]
        rt.roles.admit("decode")

    run(main())


def test_calls_left_after_the_drain_timeout_are_aborted():
    async def main():
        rt = FakeRuntime("decode")
        rt.inflight, rt.streams = 2, {"a": object(), "b": object()}
        assert await rt.roles.set_role("prefill", drain_timeout_s=0.05) == "decode"
        assert sorted(e for e in rt.events if e[0] == "abort") == [("abort", "a"), ("abort", "b")]
        assert rt.roles.role == "prefill" and ("move", "decode", "prefill") in rt.events

    run(main())


def test_calls_that_outlive_their_abort_fail_the_switch_and_keep_the_role(monkeypatch):
    monkeypatch.setattr(roles_module, "ABORT_GRACE_S", 0.1)

    async def main():
        rt = FakeRuntime("decode")
        rt.abort_ends_calls = False
        rt.inflight, rt.streams = 1, {"a": object()}
        with pytest.raises(TimeoutError, match="still serving the decode role"):
            await rt.roles.set_role("prefill", drain_timeout_s=0.05)
        assert rt.roles.role == "decode" and not rt.roles.switching
        assert rt.events[-1] == ("publish", "decode", False)  # no longer draining
        assert not any(e[0] in ("move", "metrics") for e in rt.events)
        rt.roles.admit("decode")

    run(main())


def test_concurrent_switches_are_serialized():
    async def main():
        rt = FakeRuntime("prefill")
        rt.inflight = 1
        first = asyncio.create_task(rt.roles.set_role("decode"))
        second = asyncio.create_task(rt.roles.set_role("decode"))
        back = asyncio.create_task(rt.roles.set_role("prefill"))
        await asyncio.sleep(0.1)
        assert not (first.done() or second.done() or back.done())
        rt.inflight = 0
        assert await first == "prefill"
        assert await second == "decode"  # already served: nothing to do
        assert await back == "decode" and rt.roles.role == "prefill"
        assert [e for e in rt.events if e[0] == "move"] == [("move", "prefill", "decode"),
                                                           ("move", "decode", "prefill")]

    run(main())


def test_a_cancelled_switch_keeps_the_old_role():
    async def main():
        rt = FakeRuntime("prefill")
        rt.inflight = 1
        switch = asyncio.create_task(rt.roles.set_role("decode"))
        await asyncio.sleep(0.05)
        switch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await switch
        assert rt.roles.role == "prefill" and not rt.roles.switching
        assert rt.events[-1] == ("publish", "prefill", False)
        rt.roles.admit("prefill")

    run(main())


def test_a_switch_waits_for_a_sleep_in_progress_then_is_refused():
    async def main():
        rt = FakeRuntime("prefill")
        async with rt.lifecycle.lock:  # a Sleep holds the lifecycle lock while it drains
            switch = asyncio.create_task(rt.roles.set_role("decode"))
            await asyncio.sleep(0.05)
            assert not switch.done()
            rt.lifecycle.sleeping = True
        with pytest.raises(FailedPrecondition, match="sleeping"):
            await switch

    run(main())
