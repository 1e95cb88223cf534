"""Peer pull between real workers (NIXL on loopback, real etcd): a worker that lacks a prefix
another worker holds pulls those blocks (`kv_source`) instead of computing them.

Outputs must equal a single engine's whether the KV was computed or pulled; a pull that
cannot happen (the holder lost the blocks, or is gone) falls back to computing, and the
request completes; no block stays in use on any side afterwards."""

import asyncio
import os
import random
import signal
import time

import grpc
import pytest
from pd_cluster import (
    NUM_LAYERS,
    WorkerProcess,
    decode_request,
    generate,
    health,
    metric,
    tokens_by_index,
    wait_all_blocks_free,
)

from cluster.etcd_server import EtcdServer
from engine import LLM, SamplingParams
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
BLOCK = 16


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server


@pytest.fixture(scope="module")
def workers(etcd, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    prefill = WorkerProcess("prefill", etcd.endpoint, log_dir=logs)
    decode = WorkerProcess(
        "decode", etcd.endpoint, "--kv-timeout", "20", "--enable-admin-rpcs", log_dir=logs
    )
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        assert decode.terminate() == 0
        assert prefill.terminate() == 0


@pytest.fixture(autouse=True)
def pools_are_clean_after(workers):
    yield
    for worker in workers:
        wait_all_blocks_free(worker.address, timeout=10)


@pytest.fixture(scope="module")
def reference_llm(model_dir):
    return LLM(str(model_dir), num_layers=NUM_LAYERS, kv_cache_memory=32 << 20, dtype="float32")


def _request(rid, tokens, prefill=None, source=None, num_blocks=0, **sampling):
    """`decode_request` with logprobs, and the peer holding the prompt's leading blocks."""
    sampling.setdefault("logprobs", 1)
    req = decode_request(rid, tokens, prefill, **sampling)
    if source is not None:
        req.kv_source.CopyFrom(
            pb.KVSource(worker_id=source.worker_id, address=source.address, num_blocks=num_blocks)
        )
    return req


def _prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _expected(llm, prompt, **sampling):
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", 12)
    sampling.setdefault("logprobs", 1)
    [ref] = llm.generate([prompt], SamplingParams(**sampling), use_tqdm=False)
    return ref.outputs[0]


def _assert_same(responses, ref) -> None:
    """Tokens and their logprobs equal the single engine's (a greedy token alone may
    survive KV that is slightly wrong; its logprob does not)."""
    assert tokens_by_index(responses)[0] == ref.token_ids
    got = [lp.logprob for r in responses for lp in r.logprobs]
    assert got == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)


def _pulled(worker) -> float:
    return metric(worker.metrics_address, "pdserve_worker_kv_pull_blocks_total")


def test_prefill_worker_pulls_the_decode_workers_previous_turn(workers, reference_llm):
    """Turn 1 runs P -> D; turn 2's prompt is turn 1's prompt + answer + a new message. The
    router names D as holder: P pulls turn 1's blocks — its answer's included, computed only
    on D — computes the rest, and the output equals a single engine's."""
    prefill, decode = workers
    turn1 = _prompt(1, 70)
    first = asyncio.run(generate(decode.address, _request("turn-1", turn1, prefill, max_tokens=40)))
    answer = tokens_by_index(first)[0]
    turn2 = turn1 + answer + _prompt(2, 20)
    held = (len(turn1) + len(answer) - 1) // BLOCK  # full blocks D computed and cached
    assert held * BLOCK > len(turn1) + BLOCK  # the answer's blocks are among them
    pulled_before, sent_before = (
        _pulled(prefill),
        metric(decode.metrics_address, "pdserve_worker_kv_exports_total", outcome="sent"),
    )
    hits_before = metric(prefill.metrics_address, "vllm:prefix_cache_hits_total")
    responses = asyncio.run(
        generate(decode.address, _request("turn-2", turn2, prefill, source=decode, num_blocks=held))
    )
    ref = _expected(reference_llm, turn2)
    assert {r.prefill_mode for r in responses} == {"remote"}
    _assert_same(responses, ref)
    # P held none of turn 1's answer: it pulled every block D held past P's own hit.
    p_had = len(turn1) // BLOCK
    assert _pulled(prefill) - pulled_before == held - p_had
    # ... and computed none of them: they were prefix hits there (so the KV was used).
    assert (
        metric(prefill.metrics_address, "vllm:prefix_cache_hits_total") - hits_before
        == held * BLOCK
    )
    assert (
        metric(decode.metrics_address, "pdserve_worker_kv_exports_total", outcome="sent")
        == sent_before + 1
    )


def test_decode_worker_pulls_what_the_prefill_worker_holds(workers, reference_llm):
    """Prefilling locally, D pulls the prompt's blocks from P, which computed them for an
    earlier request; greedy and seeded outputs equal a single engine's."""
    prefill, decode = workers
    shared = _prompt(3, 96)  # 6 blocks
    asyncio.run(generate(decode.address, _request("warm-p", shared + [7, 8, 9], prefill)))
    # D received those blocks from P and holds them too: make D forget them.
    asyncio.run(_reset_prefix_cache(decode))
    for rid, extra, sampling in (
        ("greedy", [11, 12, 13], {}),
        ("seeded", [14, 15], dict(temperature=0.8, seed=5)),
    ):
        before = _pulled(decode)
        responses = asyncio.run(
            generate(
                decode.address,
                _request(rid, shared + extra, source=prefill, num_blocks=6, **sampling),
            )
        )
        assert {r.prefill_mode for r in responses} == {"local"}
        _assert_same(responses, _expected(reference_llm, shared + extra, **sampling))
        assert responses[-1].usage.cached_tokens >= 6 * BLOCK
        assert _pulled(decode) - before == (6 if rid == "greedy" else 0)  # then held


def test_a_pull_the_holder_cannot_serve_falls_back_to_computing(workers, reference_llm):
    """The router's view was stale: the holder no longer has the blocks (FAILED_PRECONDITION
    there, nothing sent), or nothing serves at its address. Either way the request is
    computed and completes with the right output, and the reserved blocks come back."""
    prefill, decode = workers
    gone = pb.WorkerRef(worker_id="gone", address="127.0.0.1:1")
    for seed, rid, source in ((21, "not-held", prefill), (22, "holder-gone", gone)):
        prompt = _prompt(seed, 80)
        failed = metric(decode.metrics_address, "pdserve_worker_kv_pulls_total", outcome="failed")
        responses = asyncio.run(
            generate(decode.address, _request(rid, prompt, source=source, num_blocks=4))
        )
        _assert_same(responses, _expected(reference_llm, prompt))
        assert (
            metric(decode.metrics_address, "pdserve_worker_kv_pulls_total", outcome="failed")
            == failed + 1
        )


def test_a_stalled_holder_delays_the_request_little_and_strands_nothing(workers, reference_llm):
    """The holder stops answering mid-pull (SIGSTOP): the pull misses its deadline (what
    computing those tokens takes here) and the request is computed, right. The reserved
    blocks stay out of reuse while the holder might still write into them — no timer frees
    them — and come back once it answers again (its Abort reply)."""
    prefill, decode = workers
    shared = _prompt(31, 96)
    asyncio.run(generate(decode.address, _request("stall-warm", shared + [1], prefill)))
    for seed in (32, 33):  # D measures its prefill rate (its first prompt step is a warm-up)
        asyncio.run(generate(decode.address, _request(f"rate-{seed}", _prompt(seed, 96))))
    asyncio.run(_reset_prefix_cache(decode))
    os.kill(prefill.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        responses = asyncio.run(
            generate(
                decode.address, _request("stalled", shared + [2, 3], source=prefill, num_blocks=6)
            )
        )
        assert time.monotonic() - started < 10  # far below --kv-timeout 20
        _assert_same(responses, _expected(reference_llm, shared + [2, 3]))
        c = health(decode.address).capacity
        deadline = time.monotonic() + 5
        while c.running and time.monotonic() < deadline:  # capacity is a 0.2 s snapshot
            time.sleep(0.1)
            c = health(decode.address).capacity
        assert c.running == 0 and c.total_blocks - c.free_blocks == 6  # the pull's, quarantined
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
    wait_all_blocks_free(decode.address, timeout=30)  # released on the holder's word


def test_send_blocks_refuses_unregistered_destinations(workers):
    prefill, _ = workers
    request = pb.SendBlocksRequest(
        block_hashes=[b"x" * 32],
        destination=pb.KVDestination(
            peer_metadata=b"{}", block_ids=[0], transfer_id="pull:forged:0", deadline_s=5
        ),
    )

    async def call():
        async with grpc.aio.insecure_channel(prefill.address) as ch:
            return await pb_grpc.WorkerStub(ch).SendBlocks(request, timeout=30)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(call())
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED, err.value.details()
    # Prefill's skip fields mean nothing here: refused by name, not ignored.
    request.destination.num_skip_blocks = 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(call())
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "num_skip_blocks" in err.value.details()


async def _reset_prefix_cache(worker) -> None:
    async with grpc.aio.insecure_channel(worker.address) as ch:
        await pb_grpc.WorkerStub(ch).ResetPrefixCache(pb.LifecycleRequest(), timeout=30)
