"""The worker's phase machine and gate (worker_runtime/admission.py): which moves are legal,
what each phase refuses and with which message, and in-flight counting with wait_idle."""

import asyncio

import pytest

from cluster.roles import Role
from worker_runtime.admission import Admission, IllegalPhaseChange, WorkerPhase
from worker_runtime.grpc_errors import FailedPrecondition, Unavailable

pytestmark = pytest.mark.timeout(30)
P = WorkerPhase


def test_only_the_table_s_moves_are_legal_and_shutdown_is_terminal():
    a = Admission("decode")
    for illegal in (P.SLEEPING, P.SERVING):
        with pytest.raises(IllegalPhaseChange):
            a.move(illegal)
    a.move(P.GOING_TO_SLEEP)
    with pytest.raises(IllegalPhaseChange):
        a.move(P.UPDATING_WEIGHTS)
    a.move(P.SLEEPING)
    with pytest.raises(IllegalPhaseChange):
        a.move(P.SWITCHING_ROLE, switching_to=Role.PREFILL)
    a.move(P.SHUTTING_DOWN)  # from any phase
    for phase in P:
        if phase is not P.SHUTTING_DOWN:
            with pytest.raises(IllegalPhaseChange):
                a.move(phase, switching_to=Role.PREFILL if phase is P.SWITCHING_ROLE else None)
    a.leave(P.SLEEPING)  # shutdown took over: leaving an earlier phase changes nothing
    assert a.phase is P.SHUTTING_DOWN


def test_a_role_switch_and_only_a_role_switch_names_its_role():
    a = Admission("prefill")
    with pytest.raises(IllegalPhaseChange):
        a.move(P.SWITCHING_ROLE)
    with pytest.raises(IllegalPhaseChange):
        a.move(P.GOING_TO_SLEEP, switching_to=Role.DECODE)
    with pytest.raises(IllegalPhaseChange):
        a.switch_role()
    a.move(P.SWITCHING_ROLE, switching_to=Role.DECODE)
    assert a.switch_role() is Role.PREFILL
    assert (a.role, a.phase, a.switching_to) == (Role.DECODE, P.SERVING, None)


@pytest.mark.parametrize(
    "phases, role, error, message",
    [
        ((), Role.DECODE, FailedPrecondition, "serves the prefill role, not decode"),
        ((P.GOING_TO_SLEEP,), Role.PREFILL, Unavailable, "worker is going to sleep"),
        ((P.GOING_TO_SLEEP, P.SLEEPING), Role.PREFILL, Unavailable, "worker is sleeping"),
        ((P.UPDATING_WEIGHTS,), Role.PREFILL, Unavailable, "worker is updating weights"),
        ((P.GOING_TO_SLEEP,), Role.DECODE, FailedPrecondition, "serves the prefill role"),
        ((P.SHUTTING_DOWN,), Role.DECODE, Unavailable, "worker is draining"),
    ],
)
def test_each_phase_refuses_with_its_own_message(phases, role, error, message):
    a = Admission("prefill")
    for phase in phases:
        a.move(phase)
    with pytest.raises(error, match=message):
        with a.admitted(role, "r"):
            pass
    assert a.inflight == 0


def test_calls_count_from_admission_to_their_end_and_wait_idle_sees_them():
    async def main():
        a = Admission("decode")
        assert await a.wait_idle(0)
        with pytest.raises(ValueError, match="request_id is required"):
            with a.admitted(Role.DECODE, ""):
                pass
        ended = asyncio.Event()

        async def call():
            with a.admitted(Role.DECODE, "r"):
                await ended.wait()

        task = asyncio.create_task(call())
        await asyncio.sleep(0)
        assert a.inflight == 1
        assert not await a.wait_idle(0.05)  # bounded
        a.move(P.UPDATING_WEIGHTS)  # admitted before the phase change: runs on
        waiter = asyncio.create_task(a.wait_idle(5))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        ended.set()
        assert await waiter and a.inflight == 0
        await task

        a.leave(P.UPDATING_WEIGHTS)
        with pytest.raises(RuntimeError):  # a failing call still ends its count
            with a.admitted(Role.DECODE, "x"):
                raise RuntimeError("boom")
        assert a.inflight == 0 and await a.wait_idle(0)

    asyncio.run(main())


def test_an_unknown_role_is_refused_by_name():
    with pytest.raises(ValueError, match="role must be one of prefill, decode; got 'both'"):
        Admission("both")
