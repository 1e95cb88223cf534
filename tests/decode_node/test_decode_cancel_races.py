"""Deterministic interleavings of a Generate being cancelled with the engine thread.

The harness never runs the engine thread on its own: each test chooses exactly which engine
commands have run when the cancel arrives. Whatever the interleaving, once the prefill worker
can no longer write, no block may stay held."""

import asyncio

import pytest
from decode_fakes import Harness

pytestmark = pytest.mark.timeout(30)


def run(coro):
    return asyncio.run(coro)


def test_cancel_while_the_call_ended_command_is_queued_leaves_nothing_quarantined():
    """The race: P's Prefill returned (so P writes nothing more) and the command recording
    that is queued for the engine thread; the client cancels before the engine thread runs
    it. The cancelled command must not be dropped, or the request's blocks are quarantined
    waiting for a call end that never comes."""

    async def main():
        h = Harness()
        try:
            task = h.generate("r")
            await h.spin()
            assert len(h.calls) == 1 and h.engine.allocated["r"]
            h.calls[0].future.set_result(h.response())
            await h.spin(engine=False)  # Generate now awaits an engine command, not yet run
            task.cancel()
            await h.spin(engine=False)  # the cancel reaches the queued command first
            await h.spin()
            assert task.done()
            await h.spin()
            assert h.engine.block_manager.pool.held == [], "blocks quarantined forever"
            assert "r" not in h.engine.allocated and "r" not in h.engine.running
        finally:
            h.close()

    run(main())


async def _settled(h, task, cancel_first=True):
    if cancel_first:
        task.cancel()
    await h.spin(engine=False)
    await h.spin()
    assert task.done()


def _nothing_left(h, rid="r"):
    assert h.held == []
    assert rid not in h.engine.allocated and rid not in h.engine.running
    assert not h.worker.prefill.remote.in_flight and h.worker.prefill.remote.quarantined_blocks == 0


def test_cancel_before_the_start_command_ran_releases_without_asking_p():
    async def main():
        h = Harness()
        try:
            task = h.generate("r")
            await h.spin(engine=False)  # the start command is queued, not run
            assert len(h.calls) == 1  # P started on the prompt, its destination deferred
            await _settled(h, task)
            # P never had a destination: its call is cancelled, no Abort needed, no quarantine
            assert h.calls[0].cancelled and h.destinations == [] and h.aborts == []
            _nothing_left(h)
        finally:
            h.close()

    run(main())


@pytest.mark.parametrize("kv_landed", [False, True], ids=["parked", "kv_landed"])
def test_cancel_while_p_may_write_quarantines_until_p_confirms(kv_landed):
    async def main():
        h = Harness()
        try:
            task, call = await h.started("r", kv_landed=kv_landed)
            blocks = list(call.request.destination.block_ids)
            if kv_landed:
                assert (
                    h.worker.prefill.remote.state(call.request.destination.transfer_id).name
                    == "KV_LANDED"
                )
            h.abort_reply = asyncio.get_running_loop().create_future()  # P has not answered yet
            await _settled(h, task)
            assert call.cancelled and h.aborts == ["r"]
            assert h.held == blocks  # a late write cannot reach another request's KV
            assert h.worker.prefill.remote.quarantined_blocks == len(blocks)
            h.abort_reply.set_result(None)  # P: its sender reported the transfer
            await h.spin()
            _nothing_left(h)
        finally:
            h.close()

    run(main())


def test_cancel_after_the_first_token_while_waiting_for_kv_releases_at_once():
    async def main():
        h = Harness()
        try:
            task = h.generate("r")
            await h.spin()
            h.calls[0].future.set_result(h.response())
            await h.spin()  # FIRST_TOKEN: P writes nothing more
            assert (
                h.worker.prefill.remote.state(h.calls[0].request.destination.transfer_id).name
                == "FIRST_TOKEN"
            )
            await _settled(h, task)
            assert h.aborts == []
            _nothing_left(h)
        finally:
            h.close()

    run(main())


@pytest.mark.parametrize("kv_first", [True, False], ids=["kv_then_token", "token_then_kv"])
def test_kv_and_first_token_in_either_order_run_the_request(kv_first):
    async def main():
        h = Harness()
        try:
            task, call = await h.started("r", kv_landed=kv_first)
            call.future.set_result(h.response())
            await h.spin()
            if not kv_first:
                await h.land_kv(call)
                await h.spin()
            responses = await asyncio.wait_for(task, 5)
            assert [(r.prefill_mode, list(r.token_ids), r.finish_reason) for r in responses] == [
                ("remote", [42], "length")
            ]
            assert (
                h.engine.running == ["r"] and h.held == [] and not h.worker.prefill.remote.in_flight
            )
        finally:
            h.close()

    run(main())


def test_worker_abort_while_waiting_for_kv_ends_the_stream_and_quarantines_until_p_confirms():
    async def main():
        h = Harness()
        try:
            task = h.generate("r")
            await h.spin()
            blocks = list(h.calls[0].request.destination.block_ids)
            h.abort_reply = asyncio.get_running_loop().create_future()
            assert await h.worker.abort("r")
            await _settled(h, task, cancel_first=False)
            assert [r.finish_reason for r in task.result()] == ["abort"]
            assert h.held == blocks
            h.abort_reply.set_result(None)
            await h.spin()
            _nothing_left(h)
        finally:
            h.close()

    run(main())


def test_kv_timeout_fails_at_once_and_keeps_the_blocks_until_p_confirms_it_stopped():
    """P went silent past the progress window: the request fails then (not when P's call
    ends, which has no deadline of its own), and its blocks stay quarantined until P's
    Abort answers that nothing more of it can land."""

    async def main():
        h = Harness(kv_timeout_s=0.05)
        h.abort_reply = asyncio.get_running_loop().create_future()  # P has not confirmed
        try:
            task, call = await h.started("r")
            blocks = list(call.request.destination.block_ids)
            await asyncio.sleep(0.1)
            await h.spin()  # the receiver times out; P's call is still open
            assert task.done() and "did not arrive" in str(task.exception())
            assert "nothing from the sender for 0.05s" in str(task.exception())
            assert h.held == blocks and "r" not in h.engine.allocated
            assert h.aborts == ["r"] and call.cancelled
            h.abort_reply.set_result(None)  # P: nothing of it is in flight any more
            await h.spin()
            assert h.held == [] and not h.worker.prefill.remote.quarantined_blocks
        finally:
            h.close()

    run(main())


def test_a_prefill_longer_than_the_window_completes_while_p_keeps_it_alive():
    """The 8k-token prompt case: P takes ten of D's KV windows to compute the prompt (a fixed
    deadline failed it, and D then prefilled it again itself: twice the TTFT). P's
    keepalives keep the transfer alive; the request runs remotely on P's KV."""

    async def main():
        h = Harness(kv_timeout_s=0.05)
        try:
            task, call = await h.started("r")
            dest = call.request.destination
            h.p_kv.sender.send(dest.transfer_id, "D", [], final=False, idle_s=0.05)
            end = asyncio.get_running_loop().time() + 0.5
            while asyncio.get_running_loop().time() < end:  # P computes; its progress thread
                h.p_kv.sender.poll()  # sends keepalives
                await asyncio.sleep(0.005)
                h.run_engine()
            assert not task.done()
            await h.land_kv(call)
            call.future.set_result(h.response())
            await h.spin()
            responses = await asyncio.wait_for(task, 5)
            assert [(r.prefill_mode, list(r.token_ids)) for r in responses] == [("remote", [42])]
            assert h.aborts == [] and h.held == [] and not h.worker.prefill.remote.in_flight
        finally:
            h.close()

    run(main())


@pytest.mark.parametrize("refusal, asked", [("unavailable", 3), ("unauthenticated", 1)])
def test_a_prefill_worker_that_fails_falls_back_and_releases_once_it_cannot_write(refusal, asked):
    """Nothing serves at P's address (UNAVAILABLE): released once nothing answered three times
    in a row. P's interceptor refuses our token (UNAUTHENTICATED, a token rotation rolling
    out): P never started the attempt, so released on the first refused Abort."""

    async def main():
        import decode_fakes

        error = getattr(decode_fakes, refusal)
        h = Harness()
        try:
            task, call = await h.started("r")
            h.abort_error = error()
            call.future.set_exception(error())
            await h.fell_back("r", aborts=asked)
            task.cancel()
            await h.spin()
        finally:
            h.close()

    run(main())
