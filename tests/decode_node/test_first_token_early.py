"""A remote prefill's first token goes to the caller as soon as the prefill worker returns
it — before the decode engine's next step boundary admits the request — and exactly once;
a failure after it ends the stream with that failure, and nothing is left held.

The harness runs the engine thread only when a test says so (decode_fakes.py), so "before
the engine admitted it" is a state the test holds, not a race it hopes to win."""

import asyncio

import pytest
from decode_fakes import Harness

from engine.processing.outputs import CompletionDelta

pytestmark = pytest.mark.timeout(30)


def _nothing_left(h, rid="r"):
    assert h.held == []
    assert rid not in h.engine.allocated
    assert not h.worker.prefill.remote.in_flight and h.worker.prefill.remote.quarantined_blocks == 0


def _tokens(responses):
    return [(list(r.token_ids), r.finish_reason) for r in responses]


def _announcing(**kwargs) -> Harness:
    h = Harness(**kwargs)
    h.engine.announce_first = True
    h.engine.first_finish = None  # the stream goes on after the first token
    return h


async def _first_token_out(h: Harness) -> tuple[asyncio.Task, list]:
    """Generate "r" until P answered and its first token went out (the engine thread has
    not run since P answered); the task and the responses so far."""
    got: list = []
    task = h.generate("r", into=got)
    await h.spin()
    h.calls[0].future.set_result(h.response())
    await h.spin(engine=False)
    assert _tokens(got) == [([42], "")]
    return task, got


def test_the_first_token_is_streamed_before_the_engine_admits_the_request_and_only_once():
    async def main():
        h = _announcing()
        try:
            task, got = await _first_token_out(h)
            assert "r" not in h.engine.running  # not admitted yet
            await h.land_kv(h.calls[0])
            await h.spin()  # admitted now: its first delta is the one already sent
            assert h.engine.running == ["r"]
            assert _tokens(got) == [([42], "")]
            h.rt.deliver([_final("r")])  # the engine's next step ends it
            responses = await asyncio.wait_for(task, 5)
            assert _tokens(responses) == [([42], ""), ([7], "length")]
            assert [r.prefill_mode for r in responses] == ["remote", "remote"]
            assert h.held == [] and not h.worker.prefill.remote.in_flight
        finally:
            h.close()

    asyncio.run(main())


def test_a_first_token_that_ends_the_request_ends_the_stream_and_the_engine_still_admits_it():
    async def main():
        h = _announcing()
        h.engine.first_finish = "length"  # e.g. max_tokens == 1
        try:
            task = h.generate("r")
            await h.spin()
            call = h.calls[0]
            call.future.set_result(h.response())
            await h.spin(engine=False)
            assert task.done() and _tokens(task.result()) == [([42], "length")]
            await h.land_kv(call)
            await h.spin()  # the admission still runs (it frees the request's blocks)
            assert h.engine.running == ["r"]
            assert h.held == [] and not h.worker.prefill.remote.in_flight
        finally:
            h.close()

    asyncio.run(main())


def test_a_kv_failure_after_the_first_token_went_out_ends_the_stream_with_it():
    """P answered but the receiver reports the transfer failed (here: no word from P within
    the window): the caller has the first token, then the stream fails (the router resumes
    the request elsewhere from the tokens it has), and the blocks are released."""

    async def main():
        h = _announcing(kv_timeout_s=0.05)
        try:
            task, got = await _first_token_out(h)
            await asyncio.sleep(0.1)  # past the window, nothing landed
            await h.spin()
            assert task.done() and "did not arrive" in str(task.exception())
            assert _tokens(got) == [([42], "")]
            _nothing_left(h)
        finally:
            h.close()

    asyncio.run(main())


def test_a_cancel_after_the_first_token_went_out_releases_everything():
    async def main():
        h = _announcing()
        try:
            task, _ = await _first_token_out(h)
            task.cancel()
            await h.spin(engine=False)
            await h.spin()
            assert task.done()
            _nothing_left(h)
            assert "r" not in h.engine.running
        finally:
            h.close()

    asyncio.run(main())


def _final(rid: str) -> CompletionDelta:
    return CompletionDelta(
        request_id=rid,
        index=0,
        token_ids=[7],
        text="",
        logprobs=[],
        finish_reason="length",
        num_prompt_tokens=12,
        num_cached_tokens=12,
        num_output_tokens=2,
    )


def test_the_prefill_workers_reported_delay_is_never_taken_negative():
    """`answer_delay_s` is the peer's figure: a negative one counts as 0 (the handover would
    otherwise start after the answer arrived)."""

    async def main():
        h = _announcing()
        try:
            task = h.generate("r")
            await h.spin()
            answer = h.response()
            answer.answer_delay_s = -5.0
            h.calls[0].future.set_result(answer)
            await h.spin(engine=False)
            h.rt.metrics.kv_handover_prefill.observe.assert_called_once_with(0.0)
            task.cancel()
            await h.spin()
        finally:
            h.close()

    asyncio.run(main())
