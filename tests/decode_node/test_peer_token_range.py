"""A token a peer sends is range-checked against the model's vocabulary before it is used: a
first token from a prefill worker outside [0, vocab_size) is a failed prefill (the decode
worker aborts P's attempt and prefills here, or fails the request with a message under
--strict-remote-prefill), never an index error later."""

import asyncio
import logging

import pytest
from decode_fakes import VOCAB_SIZE, Harness

from cluster.convert import TokenOutOfRange, sampled_from_pb
from proto import pdserve_pb2 as pb

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    "token",
    [
        pb.TokenLogprob(token_id=VOCAB_SIZE),
        pb.TokenLogprob(token_id=2**32 - 1),
        pb.TokenLogprob(token_id=3, top=[pb.TopLogprob(token_id=2**31 - 1, logprob=-1.0)]),
    ],
)
def test_a_token_outside_the_vocabulary_is_refused(token):
    with pytest.raises(TokenOutOfRange, match=rf"outside the vocabulary \[0, {VOCAB_SIZE}\)"):
        sampled_from_pb(token, with_logprobs=True, vocab_size=VOCAB_SIZE)
    last = pb.TokenLogprob(token_id=VOCAB_SIZE - 1)
    assert sampled_from_pb(last, False, VOCAB_SIZE).token_id == VOCAB_SIZE - 1


def test_a_first_token_outside_the_vocabulary_fails_the_prefill_and_falls_back(caplog):
    async def main():
        h = Harness()
        try:
            task, call = await h.started("r", kv_landed=True)
            call.future.set_result(
                pb.PrefillResponse(first_token=pb.TokenLogprob(token_id=VOCAB_SIZE + 7))
            )
            await h.fell_back("r")
            assert not h.worker.prefill.remote.in_flight
            task.cancel()
            await h.spin()
        finally:
            h.close()

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    assert f"INTERNAL: first token id {VOCAB_SIZE + 7} is outside the vocabulary" in caplog.text
