"""A Generate whose constraint does not compile within --grammar-compile-timeout ends as
INVALID_ARGUMENT naming the field, at the limit, and leaves nothing behind: no KV blocks, no
stream, no prefill call, nothing in flight; the next structured call is served (the request
is built by the real RequestBuilder, its compile in the real child process)."""

import asyncio
import time

import grpc
import pytest
from decode_fakes import Harness

from engine.processing.request_builder import RequestBuilder
from engine.processing.tokenizer import Tokenizer
from engine.structured.compile_process import CompileLimits
from engine.structured.params import StructuredOutputsParams
from proto import pdserve_pb2 as pb
from worker_runtime.grpc_errors import status_for

pytestmark = pytest.mark.timeout(120)

PATHOLOGICAL = '{"type": "string", "pattern": "(((ab|a){0,20}){0,20}){0,20}"}'
LIMIT_S = 1.0


def _generate(h: Harness, rid: str, schema: str) -> asyncio.Task:
    request = pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=[1, 2, 3, 4, 5],
        sampling=pb.SamplingParams(
            temperature=0.0, max_tokens=3, structured_outputs=pb.StructuredOutputs(json=schema)
        ),
        prefill_worker=pb.WorkerRef(worker_id="P", address="p:1"),
    )

    async def consume():
        return [r async for r in h.worker.Generate(request, None)]

    return asyncio.ensure_future(consume())


def test_a_pathological_schema_is_invalid_argument_and_takes_nothing(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    builder = RequestBuilder(
        tok,
        tok.vocab_size,
        512,
        4,
        seed=0,
        # No repetition limit: it would refuse PATHOLOGICAL before any compile.
        grammar_limits=CompileLimits(timeout_s=LIMIT_S, max_repetitions=0),
    )

    async def main():
        h = Harness()
        h.engine.make_request = (
            lambda rid, prompt, params, salt, priority, *, resume, pooling, lora_request: (
                builder.build(rid, prompt, params, salt, priority, resume, pooling)
            )
        )
        try:
            # Start the child: what is timed below is the compile.
            await asyncio.to_thread(
                builder.grammars.compile, StructuredOutputsParams(regex="[0-9]")
            )
            start = time.monotonic()
            task = _generate(h, "bad", PATHOLOGICAL)
            with pytest.raises(ValueError, match="did not compile within 1 s") as refused:
                await asyncio.wait_for(task, 30)
            assert time.monotonic() - start < LIMIT_S + 1.5
            assert refused.value.field == "json"
            assert status_for(refused.value) == grpc.StatusCode.INVALID_ARGUMENT
            assert (h.calls, h.engine.allocated, h.rt.streams, h.held) == ([], {}, {}, [])
            assert h.rt.admission.inflight == 0

            task = _generate(h, "good", '{"type": "integer"}')  # a fresh child compiles it
            for _ in range(600):
                await h.spin()
                if h.calls:
                    break
                await asyncio.sleep(0.05)
            assert len(h.calls) == 1 and h.engine.allocated
            task.cancel()
            await h.spin()
        finally:
            h.close()
            builder.grammars.close()

    asyncio.run(main())
