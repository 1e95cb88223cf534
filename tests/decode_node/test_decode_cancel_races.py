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
            assert h.engine.block_manager.held == [], "blocks quarantined forever"
            assert "r" not in h.engine.allocated and "r" not in h.engine.running
        finally:
            h.close()

    run(main())
