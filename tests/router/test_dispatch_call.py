"""One Generate call in the dispatcher, against a fake channel pool (no etcd, no gRPC server):
in-flight accounting on both workers however the call ends, its metrics, failure
classification."""

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from engine.sampling.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from router.call import WorkerFailed
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.http.errors import APIError
from router.metrics import RouterMetrics
from router.placement.placer import Placement, PromptKey
from router.placement.policy import Decision, Reason
from router.placement.registry import WorkerRegistry, WorkerState

PROMPT = PromptKey(list(range(10)))
CACHED_ON_PREFILL = 4  # the prefill worker's share: 6 tokens


class FakeCall:
    """Yields `messages`; a None among them blocks forever (a worker still computing)."""

    def __init__(self, messages):
        self.messages = messages
        self.cancelled = False

    def __aiter__(self):
        return self._stream()

    async def _stream(self):
        for m in self.messages:
            if m is None:
                await asyncio.Event().wait()
            elif isinstance(m, Exception):
                raise m
            yield m

    def cancel(self):
        self.cancelled = True


class FakeChannels:
    def __init__(self, call):
        self.call = call
        self.held = 0

    def hold_decode(self, address):
        self.held += 1
        return SimpleNamespace(Generate=lambda request: self.call)

    def release(self, address):
        self.held -= 1


def _worker(worker_id):
    return WorkerState(SimpleNamespace(worker_id=worker_id, grpc_address=f"{worker_id}:1"), 0.0)


def _setup(messages):
    call = FakeCall(messages)
    channels = FakeChannels(call)
    metrics = RouterMetrics()
    placer = SimpleNamespace(registry=WorkerRegistry(), policy=SimpleNamespace(name="affinity"))
    dispatcher = Dispatcher(RouterConfig(etcd="unused:1"), placer, channels, metrics)
    decision = Decision(
        decode=None,
        prefill=SimpleNamespace(cached_tokens=CACHED_ON_PREFILL),
        reason=Reason.REMOTE,
        predicted_cached_tokens=CACHED_ON_PREFILL,
    )
    placement = Placement(decision, _worker("d"), _worker("p"))
    stream = dispatcher._run(placement, PROMPT, SamplingParams(max_tokens=2), 0.0, 0)
    return stream, placement, call, channels, metrics


def _value(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels) or 0.0


def _msg(tokens=(), finish="", cached=0):
    return pb.GenerateResponse(
        index=0, token_ids=list(tokens), finish_reason=finish, usage=pb.Usage(cached_tokens=cached)
    )


def _assert_released(placement, call, channels, metrics):
    assert placement.decode.inflight == 0 and placement.prefill.inflight_prefill_tokens == 0
    assert call.cancelled and channels.held == 0
    assert _value(metrics, "pdserve_router_running_requests") == 0


def test_counts_follow_the_call_and_the_prefill_share_ends_at_the_first_token():
    async def main():
        stream, placement, call, channels, metrics = _setup(
            [_msg(cached=CACHED_ON_PREFILL), _msg([7]), _msg([8], finish="length")]
        )
        await anext(stream)  # no token yet
        assert placement.decode.inflight == 1 and channels.held == 1
        assert (
            placement.prefill.inflight_prefill_tokens == len(PROMPT.token_ids) - CACHED_ON_PREFILL
        )
        assert _value(metrics, "pdserve_router_running_requests") == 1
        await anext(stream)  # the first token
        assert placement.decode.inflight == 1 and placement.prefill.inflight_prefill_tokens == 0
        await anext(stream)
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        _assert_released(placement, call, channels, metrics)
        assert _value(metrics, "pdserve_router_ttft_seconds_count") == 1
        assert _value(metrics, "pdserve_router_itl_seconds_count") == 1
        assert _value(metrics, "pdserve_router_generation_tokens_total") == 2
        assert _value(metrics, "pdserve_router_e2e_seconds_count") == 1
        assert _value(metrics, "pdserve_router_prompt_tokens_total") == len(PROMPT.token_ids)
        for source in ("predicted", "reported"):
            assert (
                _value(metrics, "pdserve_router_prefix_hit_tokens_total", source=source)
                == CACHED_ON_PREFILL
            )

    asyncio.run(main())


def test_closing_early_cancels_the_call_and_returns_every_count():
    async def main():
        stream, placement, call, channels, metrics = _setup([_msg(), _msg([7]), None])
        await anext(stream)
        await stream.aclose()
        _assert_released(placement, call, channels, metrics)
        assert _value(metrics, "pdserve_router_e2e_seconds_count") == 0

    asyncio.run(main())


def test_task_cancellation_returns_every_count():
    async def main():
        stream, placement, call, channels, metrics = _setup([_msg(), None])

        async def consume():
            async for _ in stream:
                pass

        task = asyncio.create_task(consume())
        while channels.held == 0 or placement.decode.inflight == 0:
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        _assert_released(placement, call, channels, metrics)

    asyncio.run(main())


def _rpc_error(code):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="no")


@pytest.mark.parametrize(
    "messages, expected, after_first_token",
    [
        ([_msg(finish="error")], WorkerFailed, False),
        ([_msg([7]), _msg(finish="abort")], WorkerFailed, True),
        ([_msg([7])], WorkerFailed, True),  # the stream ended with the completion unfinished
        ([_rpc_error(grpc.StatusCode.UNAVAILABLE)], WorkerFailed, False),
        ([_msg([7]), _rpc_error(grpc.StatusCode.INVALID_ARGUMENT)], WorkerFailed, True),
        ([_rpc_error(grpc.StatusCode.INVALID_ARGUMENT)], APIError, None),
    ],
)
def test_failures_are_classified(messages, expected, after_first_token):
    async def main():
        stream, placement, call, channels, metrics = _setup(messages)
        with pytest.raises(expected) as info:
            async for _ in stream:
                pass
        if expected is WorkerFailed:
            assert info.value.after_first_token is after_first_token
        else:
            assert info.value.status == 400
        _assert_released(placement, call, channels, metrics)
        assert _value(metrics, "pdserve_router_e2e_seconds_count") == 0

    asyncio.run(main())


def test_a_local_prefill_is_prefill_work_on_the_decode_worker_and_teaches_the_policy():
    """Placed locally, the prompt's uncached part counts as queued prefill on the decode
    worker until its first token; that first token's time since placement is what the
    local estimate is corrected by."""
    from cluster.roles import PrefillPath
    from router.placement.estimates import TTFTCorrection

    async def main():
        call = FakeCall([_msg(), _msg([7], finish="length")])
        correction = TTFTCorrection()
        placer = SimpleNamespace(
            registry=WorkerRegistry(),
            policy=SimpleNamespace(name="affinity", correction=correction),
        )
        dispatcher = Dispatcher(
            RouterConfig(etcd="unused:1"), placer, FakeChannels(call), RouterMetrics()
        )
        decision = Decision(
            decode=SimpleNamespace(cached_tokens=2),
            prefill=None,
            reason=Reason.LOCAL_BACKLOG,
            predicted_cached_tokens=2,
            estimated_ttft_s=10.0,
        )
        placement = Placement(decision, _worker("d"), None)
        stream = dispatcher._run(placement, PROMPT, SamplingParams(max_tokens=1), 0.0, 0)
        await anext(stream)  # no token yet
        assert placement.decode.inflight_prefill_tokens == len(PROMPT.token_ids) - 2
        assert correction.error_s(PrefillPath.LOCAL) == 0.0
        await anext(stream)  # the first token
        assert placement.decode.inflight_prefill_tokens == 0
        # Observed within a second, estimated 10 s: the local path learned it overestimates.
        assert -1.0 < correction.error_s(PrefillPath.LOCAL) < -0.9
        assert correction.error_s(PrefillPath.REMOTE) == 0.0
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        assert placement.decode.inflight == 0

    asyncio.run(main())
