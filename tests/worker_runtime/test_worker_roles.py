"""The SetRole state machine (worker_runtime/roles.py) over a real Admission and recording
collaborators: what a switch publishes, drains, aborts and moves, and what it refuses
(unknown role, sleeping, shutting down, a drain that cannot end)."""

import asyncio
from contextlib import ExitStack

import pytest

from cluster.roles import Role
from worker_runtime import roles as roles_module
from worker_runtime.admission import Admission, WorkerPhase
from worker_runtime.grpc_errors import FailedPrecondition, Unavailable
from worker_runtime.roles import WorkerRoles

pytestmark = pytest.mark.timeout(30)


class FakeWorker:
    """A WorkerRoles with its collaborators; calls in flight are real admissions that the
    test (or an abort) ends; records what the switch asked for."""

    def __init__(self, role: str = "prefill", drain_timeout_s: float = 5.0) -> None:
        self.admission = Admission(role)
        self.events: list[tuple] = []
        self.calls: dict[str, ExitStack] = {}
        self.abort_ends_calls = True  # an aborted call ends (its in-flight count drops)
        self.roles = WorkerRoles(
            self.admission,
            self._publish,
            self._move,
            self._abort_all,
            self._switched,
            drain_timeout_s=drain_timeout_s,
        )

    def start_call(self, request_id: str) -> None:
        stack = self.calls[request_id] = ExitStack()
        stack.enter_context(self.admission.admitted(self.admission.role, request_id))

    def end_call(self, request_id: str) -> None:
        self.calls.pop(request_id).close()

    async def _publish(self) -> None:
        self.events.append(
            ("publish", self.admission.role, self.admission.phase.published_draining)
        )

    async def _move(self, old_role: str) -> None:
        self.events.append(("move", old_role, self.admission.role))

    async def _abort_all(self) -> None:
        for request_id in list(self.calls):
            self.events.append(("abort", request_id))
            if self.abort_ends_calls:
                self.end_call(request_id)

    def _switched(self, role: Role, previous: Role) -> None:
        self.events.append(("metrics", previous, role))

    @property
    def switching(self) -> bool:
        return self.admission.phase is WorkerPhase.SWITCHING_ROLE


def run(coro):
    return asyncio.run(coro)


def test_the_gate_admits_only_the_role_served_now():
    rt = FakeWorker("prefill")
    rt.admission.check(Role.PREFILL)
    with pytest.raises(FailedPrecondition, match="serves the prefill role, not decode"):
        rt.admission.check(Role.DECODE)
    rt.admission.move(WorkerPhase.SWITCHING_ROLE, switching_to=Role.DECODE)
    for role in Role:
        with pytest.raises(Unavailable, match="switching from the prefill role to the decode"):
            rt.admission.check(role)


def test_same_role_is_a_no_op_and_bad_arguments_are_refused():
    async def main():
        rt = FakeWorker("decode")
        assert await rt.roles.set_role("decode") == "decode"
        assert rt.events == [] and rt.admission.role == "decode"
        with pytest.raises(ValueError, match="role must be one of prefill, decode"):
            await rt.roles.set_role("both")
        with pytest.raises(ValueError, match="drain_timeout_s"):
            await rt.roles.set_role("prefill", -1.0)
        with pytest.raises(ValueError, match="drain_timeout_s"):
            await rt.roles.set_role("prefill", float("nan"))
        assert rt.admission.role == "decode" and not rt.switching

    run(main())


@pytest.mark.parametrize(
    "state, message",
    [
        ("sleeping", "sleeping: wake it up"),
        ("paused", "going to sleep"),
        ("draining", "shutting down"),
    ],
)
def test_a_switch_is_refused_while_sleeping_pausing_or_shutting_down(state, message):
    async def main():
        rt = FakeWorker("prefill")
        if state == "sleeping":
            rt.admission.move(WorkerPhase.GOING_TO_SLEEP)
            rt.admission.move(WorkerPhase.SLEEPING)
        elif state == "paused":
            rt.admission.move(WorkerPhase.GOING_TO_SLEEP)
        else:
            rt.admission.move(WorkerPhase.SHUTTING_DOWN)
        with pytest.raises(FailedPrecondition, match=message):
            await rt.roles.set_role("decode")
        assert rt.admission.role == "prefill" and not rt.switching and rt.events == []

    run(main())


def test_a_switch_publishes_draining_waits_for_in_flight_calls_then_moves():
    async def main():
        rt = FakeWorker("prefill")
        rt.start_call("a")
        switch = asyncio.create_task(rt.roles.set_role("decode"))
        await asyncio.sleep(0.1)
        assert not switch.done() and rt.switching
        assert rt.events == [("publish", "prefill", True)]  # draining, under the old role
        with pytest.raises(Unavailable):
            rt.start_call("b")
        rt.end_call("a")  # the last Prefill call returned
        assert await switch == "prefill"
        assert rt.admission.role == "decode" and not rt.switching
        assert rt.events[1:] == [("metrics", "prefill", "decode"), ("move", "prefill", "decode")]
        rt.admission.check(Role.DECODE)

    run(main())


def test_calls_left_after_the_drain_timeout_are_aborted():
    async def main():
        rt = FakeWorker("decode")
        rt.start_call("a")
        rt.start_call("b")
        assert await rt.roles.set_role("prefill", drain_timeout_s=0.05) == "decode"
        assert sorted(e for e in rt.events if e[0] == "abort") == [("abort", "a"), ("abort", "b")]
        assert rt.admission.role == "prefill" and ("move", "decode", "prefill") in rt.events
        assert rt.admission.inflight == 0

    run(main())


def test_calls_that_outlive_their_abort_fail_the_switch_and_keep_the_role(monkeypatch):
    monkeypatch.setattr(roles_module, "ABORT_GRACE_S", 0.1)

    async def main():
        rt = FakeWorker("decode")
        rt.abort_ends_calls = False
        rt.start_call("a")
        with pytest.raises(TimeoutError, match="still serving the decode role"):
            await rt.roles.set_role("prefill", drain_timeout_s=0.05)
        assert rt.admission.role == "decode" and not rt.switching
        assert rt.events[-1] == ("publish", "decode", False)  # no longer draining
        assert not any(e[0] in ("move", "metrics") for e in rt.events)
        rt.admission.check(Role.DECODE)

    run(main())


def test_concurrent_switches_are_serialized():
    async def main():
        rt = FakeWorker("prefill")
        rt.start_call("a")
        first = asyncio.create_task(rt.roles.set_role("decode"))
        second = asyncio.create_task(rt.roles.set_role("decode"))
        back = asyncio.create_task(rt.roles.set_role("prefill"))
        await asyncio.sleep(0.1)
        assert not (first.done() or second.done() or back.done())
        rt.end_call("a")
        assert await first == "prefill"
        assert await second == "decode"  # already served: nothing to do
        assert await back == "decode" and rt.admission.role == "prefill"
        assert [e for e in rt.events if e[0] == "move"] == [
            ("move", "prefill", "decode"),
            ("move", "decode", "prefill"),
        ]

    run(main())


def test_a_cancelled_switch_keeps_the_old_role():
    async def main():
        rt = FakeWorker("prefill")
        rt.start_call("a")
        switch = asyncio.create_task(rt.roles.set_role("decode"))
        await asyncio.sleep(0.05)
        switch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await switch
        assert rt.admission.role == "prefill" and not rt.switching
        assert rt.events[-1] == ("publish", "prefill", False)
        rt.admission.check(Role.PREFILL)

    run(main())


def test_a_switch_waits_for_a_sleep_in_progress_then_is_refused():
    async def main():
        rt = FakeWorker("prefill")
        async with rt.admission.changing:  # a Sleep holds the lock while it drains
            rt.admission.move(WorkerPhase.GOING_TO_SLEEP)
            switch = asyncio.create_task(rt.roles.set_role("decode"))
            await asyncio.sleep(0.05)
            assert not switch.done()
            rt.admission.move(WorkerPhase.SLEEPING)
        with pytest.raises(FailedPrecondition, match="sleeping"):
            await switch

    run(main())
