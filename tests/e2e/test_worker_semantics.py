"""Decode-worker semantics with real processes (real etcd, KV over NIXL):
- `Worker.Abort`: the request's Generate stream ends normally with a final "abort" update,
  nothing is leaked, and a request aborted while its KV is still being written does not take
  the engine down when the KV lands;
- `--max-num-seqs` also bounds requests parked for KV from a prefill worker."""

import asyncio
import random
import signal
import time

import grpc
import pytest
from pd_cluster import WorkerProcess, ahealth, decode_request, generate, wait_all_blocks_free

from cluster.etcd_server import EtcdServer
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
MAX_NUM_SEQS = 2


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    with EtcdServer() as etcd:
        # A tiny prefill budget: a long prompt takes P many steps, so D waits for its KV.
        prefill = WorkerProcess(
            "prefill", etcd.endpoint, "--max-num-batched-tokens", "16", log_dir=logs
        )
        decode = WorkerProcess(
            "decode",
            etcd.endpoint,
            "--kv-timeout",
            "30",
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            log_dir=logs,
        )
        try:
            yield prefill.wait_ready(), decode.wait_ready()
        finally:
            assert decode.terminate() == 0
            assert prefill.terminate() == 0


def _prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


async def _abort(address: str, request_id: str) -> bool:
    async with grpc.aio.insecure_channel(address) as ch:
        return (
            await pb_grpc.WorkerStub(ch).Abort(pb.AbortRequest(request_id=request_id), timeout=10)
        ).found


def test_abort_of_a_running_request_ends_its_stream_with_a_final_update(workers):
    prefill, decode = workers

    async def run():
        async with grpc.aio.insecure_channel(decode.address) as ch:
            call = pb_grpc.DecodeWorkerStub(ch).Generate(
                decode_request(
                    "abort-running",
                    _prompt(40, 1),
                    prefill,
                    n=2,
                    max_tokens=100000,
                    ignore_eos=True,
                )
            )
            responses = [await call.read()]  # a token is out: the request is running
            assert await _abort(decode.address, "abort-running")
            while (r := await call.read()) is not grpc.aio.EOF:
                responses.append(r)
            return responses, await call.code()

    responses, code = asyncio.run(run())
    assert code is grpc.StatusCode.OK  # ended normally, not by an error
    finals = {r.index: r.finish_reason for r in responses if r.finish_reason}
    assert finals == {0: "abort", 1: "abort"}
    assert not asyncio.run(_abort(decode.address, "abort-running"))  # gone: nothing to abort
    wait_all_blocks_free(decode.address)
    wait_all_blocks_free(prefill.address)


def test_abort_while_waiting_for_kv_then_the_worker_keeps_serving(workers):
    prefill, decode = workers
    long_prompt = _prompt(6000, 2)

    async def run():
        async with grpc.aio.insecure_channel(decode.address) as ch:
            call = pb_grpc.DecodeWorkerStub(ch).Generate(
                decode_request("abort-parked", long_prompt, prefill, max_tokens=4)
            )
            deadline = time.monotonic() + 20
            while (await ahealth(prefill.address)).capacity.running == 0:  # P is computing it
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            prefill.proc.send_signal(signal.SIGSTOP)  # its KV cannot complete now
            try:
                while (await ahealth(decode.address)).capacity.running == 0:  # parked for its KV
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                assert await _abort(decode.address, "abort-parked")
                responses = []
                while (r := await call.read()) is not grpc.aio.EOF:
                    responses.append(r)
                return responses, await call.code()
            finally:
                # P wakes up to a cancelled call and an Abort; whatever it still writes lands
                # in blocks the decode worker holds until P confirmed the abort.
                prefill.proc.send_signal(signal.SIGCONT)

    responses, code = asyncio.run(run())
    assert code is grpc.StatusCode.OK
    assert [(r.finish_reason, list(r.token_ids)) for r in responses] == [("abort", [])]
    wait_all_blocks_free(decode.address, timeout=15)
    wait_all_blocks_free(prefill.address, timeout=15)
    # The engine thread is alive: a new request runs to completion through both workers.
    after = asyncio.run(
        generate(
            decode.address, decode_request("after-abort", _prompt(30, 3), prefill, max_tokens=3)
        )
    )
    assert [r.finish_reason for r in after if r.finish_reason] == ["length"]
    assert {r.prefill_mode for r in after} == {"remote"}


def test_max_num_seqs_bounds_requests_waiting_for_kv(workers):
    prefill, decode = workers

    async def run():
        calls = [
            asyncio.ensure_future(
                generate(
                    decode.address,
                    decode_request(f"seqs-{i}", _prompt(600, 10 + i), prefill, max_tokens=2),
                )
            )
            for i in range(4)
        ]
        peak = 0
        while not all(c.done() for c in calls):
            peak = max(peak, (await ahealth(decode.address)).capacity.running)  # running + parked
            await asyncio.sleep(0.005)
        return peak, [await c for c in calls]

    peak, results = asyncio.run(run())
    assert peak <= MAX_NUM_SEQS
    assert all([r.finish_reason for r in rs if r.finish_reason] == ["length"] for rs in results)
    wait_all_blocks_free(decode.address)
