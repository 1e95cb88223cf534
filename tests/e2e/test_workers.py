"""Prefill + decode workers as real processes on loopback with a real etcd; KV over NIXL. The
headline: greedy outputs through decode + prefill (KV streamed block by block over NIXL, several
transfer batches per request) are token-identical to a single engine's. A worker's
registration over its life: test_worker_registration.py."""

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
    ahealth,
    cancel_once_started,
    decode_request,
    generate,
    metric,
    registration,
    tokens_by_index,
    wait_all_blocks_free,
)

from cluster.etcd_server import EtcdServer
from engine import LLM, SamplingParams
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server


@pytest.fixture(scope="module")
def workers(etcd, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    # A tiny prefill token budget: every prompt is chunked into several transfer batches.
    prefill = WorkerProcess(
        "prefill", etcd.endpoint, "--max-num-batched-tokens", "24", log_dir=logs
    )
    decode = WorkerProcess("decode", etcd.endpoint, "--kv-timeout", "20", log_dir=logs)
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        assert decode.terminate() == 0
        assert prefill.terminate() == 0


@pytest.fixture(autouse=True)
def pools_are_clean_after(request):
    yield
    if "workers" in request.fixturenames:
        prefill, decode = request.getfixturevalue("workers")
        wait_all_blocks_free(prefill.address)
        wait_all_blocks_free(decode.address)


@pytest.fixture(scope="module")
def reference_llm(model_dir):
    return LLM(str(model_dir), num_layers=NUM_LAYERS, kv_cache_memory=32 << 20, dtype="float32")


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 150))] for _ in range(n)]


def test_disaggregated_greedy_equals_single_engine(workers, reference_llm):
    prefill, decode = workers
    prompts = _prompts(8)
    sent_before = metric(
        decode.metrics_address, "pdserve_kv_transfer_blocks_total", direction="receive"
    )

    async def run_all():
        return await asyncio.gather(
            *[
                generate(decode.address, decode_request(f"parity-{i}", p, prefill))
                for i, p in enumerate(prompts)
            ]
        )

    results = asyncio.run(run_all())
    expected = reference_llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
    )
    for responses, ref in zip(results, expected):
        assert {r.prefill_mode for r in responses} == {"remote"}
        assert tokens_by_index(responses)[0] == ref.outputs[0].token_ids
        assert responses[-1].finish_reason == ref.outputs[0].finish_reason
        assert "".join(r.text for r in responses) == ref.outputs[0].text
    landed = (
        metric(decode.metrics_address, "pdserve_kv_transfer_blocks_total", direction="receive")
        - sent_before
    )
    assert landed == sum(-(-len(p) // 16) for p in prompts)
    # Per-request transfer latency is a histogram on both sides' /metrics.
    for worker, direction in ((decode, "receive"), (prefill, "send")):
        assert metric(
            worker.metrics_address, "pdserve_kv_transfer_latency_seconds_count", direction=direction
        ) >= len(prompts)


def test_seeded_sampling_across_workers_equals_single_engine(workers, reference_llm):
    prefill, decode = workers
    [prompt] = _prompts(1, seed=3)
    responses = asyncio.run(
        generate(
            decode.address,
            decode_request(
                "seeded",
                prompt,
                prefill,
                temperature=0.9,
                top_p=0.9,
                seed=42,
                max_tokens=10,
                logprobs=2,
            ),
        )
    )
    [ref] = reference_llm.generate(
        [prompt],
        SamplingParams(temperature=0.9, top_p=0.9, seed=42, max_tokens=10, logprobs=2),
        use_tqdm=False,
    )
    assert tokens_by_index(responses)[0] == ref.outputs[0].token_ids
    got = [lp.logprob for r in responses for lp in r.logprobs]
    assert got == pytest.approx([lp.logprob for lp in ref.outputs[0].logprobs], abs=1e-4)


def test_decode_side_prefix_reuse_transfers_only_missing_blocks(workers):
    prefill, decode = workers
    shared = list(range(1000, 1200))  # 200 tokens: 12 full blocks (+ 8)
    first, second = shared + [5, 6, 7], shared + [8, 9, 10, 11, 12]
    asyncio.run(generate(decode.address, decode_request("prefix-a", first, prefill)))
    before = metric(decode.metrics_address, "pdserve_kv_transfer_blocks_total", direction="receive")
    responses = asyncio.run(generate(decode.address, decode_request("prefix-b", second, prefill)))
    landed = (
        metric(decode.metrics_address, "pdserve_kv_transfer_blocks_total", direction="receive")
        - before
    )
    assert landed == -(-len(second) // 16) - 12  # only the blocks after the shared 12
    assert responses[-1].usage.cached_tokens >= 192


def test_local_prefill_without_a_prefill_worker(workers, reference_llm):
    _, decode = workers
    [prompt] = _prompts(1, seed=5)
    responses = asyncio.run(
        generate(decode.address, decode_request("local", prompt, n=2, temperature=0.7, seed=3))
    )
    assert {r.prefill_mode for r in responses} == {"local"}
    got = tokens_by_index(responses)
    [ref] = reference_llm.generate(
        [prompt], SamplingParams(n=2, temperature=0.7, seed=3, max_tokens=12), use_tqdm=False
    )
    assert [got[0], got[1]] == [c.token_ids for c in ref.outputs]


def test_unreachable_prefill_worker_falls_back_to_local(workers, reference_llm):
    _, decode = workers
    [prompt] = _prompts(1, seed=9)
    req = decode_request("fallback", prompt)
    req.prefill_worker.CopyFrom(pb.WorkerRef(worker_id="gone", address="127.0.0.1:1"))
    responses = asyncio.run(generate(decode.address, req))
    assert {r.prefill_mode for r in responses} == {"local_fallback"}
    [ref] = reference_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    assert tokens_by_index(responses)[0] == ref.outputs[0].token_ids


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(prompt_token_ids=[]), "empty"),
        (dict(prompt_token_ids=[1] * 9000), "maximum context length"),
        (dict(prompt_token_ids=[1, 10**7]), "token ids"),
        (dict(sampling=pb.SamplingParams(temperature=-1)), "temperature"),
        (dict(sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
        (dict(request_id=""), "request_id"),
    ],
)
def test_invalid_requests_are_invalid_argument(workers, bad, message):
    _, decode = workers
    req = decode_request("bad", [1, 2, 3])
    for field, value in bad.items():
        if field == "prompt_token_ids":
            del req.prompt_token_ids[:]
            req.prompt_token_ids.extend(value)
        elif field == "sampling":
            req.sampling.CopyFrom(value)
        else:
            setattr(req, field, value)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(generate(decode.address, req))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_prefill_writes_only_into_registered_workers(workers, etcd):
    """A Prefill whose destination names a KV agent no registration in etcd names is refused
    before anything is sent (the registered decode worker's own metadata passes: every other
    test here prefills through it)."""
    prefill, decode = workers

    registered = asyncio.run(registration(etcd.endpoint, decode)).kv_metadata.encode("ascii")

    def prefill_to(metadata: bytes, rid: str):
        request = pb.PrefillRequest(
            request_id=rid,
            prompt_token_ids=list(range(100, 132)),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=1, seed=1),
            destination=pb.KVDestination(
                peer_metadata=metadata, block_ids=[0, 1], transfer_id=f"{rid}:0", deadline_s=5
            ),
        )

        async def call():
            async with grpc.aio.insecure_channel(prefill.address) as ch:
                return await pb_grpc.PrefillWorkerStub(ch).Prefill(request, timeout=30)

        return asyncio.run(call())

    for forged in (registered[:-8] + b"AAAAAAAA", b"{}", b""):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            prefill_to(forged, "forged")
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED, err.value.details()
        assert "names no worker registered" in err.value.details()


@pytest.mark.parametrize("order", ["prefill_first", "destination_first"])
def test_a_deferred_destination_that_does_not_fit_the_prompt_fails_that_prefill(
    workers, etcd, order
):
    """Prefill with its destination deferred, then SetDestination naming 3 blocks for a
    2-block prompt (or the two calls the other way round): INVALID_ARGUMENT on the Prefill
    call, nothing written, every block of P free again."""
    prefill, decode = workers

    async def run() -> grpc.aio.AioRpcError:
        info = await registration(etcd.endpoint, decode)
        tid = f"deferred-{order}:0"
        request = pb.PrefillRequest(
            request_id=f"deferred-{order}",
            prompt_token_ids=list(range(100, 132)),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=1, seed=1),
            destination=pb.KVDestination(
                peer_metadata=info.kv_metadata.encode("ascii"),
                transfer_id=tid,
                deadline_s=20,
                deferred=True,
            ),
        )
        wrong = pb.KVDestination(transfer_id=tid, block_ids=[0, 1, 2])
        async with grpc.aio.insecure_channel(prefill.address) as ch:
            stub = pb_grpc.PrefillWorkerStub(ch)
            if order == "destination_first":
                await stub.SetDestination(wrong, timeout=10)
            call = stub.Prefill(request, timeout=30)
            if order == "prefill_first":
                await asyncio.sleep(0.5)  # P computes the prompt and holds its blocks meanwhile
                assert not call.done()
                await stub.SetDestination(wrong, timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            return err.value

    err = asyncio.run(run())
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "covers 3 blocks" in err.details()
    wait_all_blocks_free(prefill.address)


def test_client_cancel_aborts_and_frees_within_a_second(workers):
    prefill, decode = workers

    async def start_and_cancel():
        async with grpc.aio.insecure_channel(decode.address) as ch:
            call = pb_grpc.DecodeWorkerStub(ch).Generate(
                decode_request(
                    "cancel-me",
                    _prompts(1, seed=11)[0],
                    prefill,
                    max_tokens=100000,
                    ignore_eos=True,
                )
            )
            async for _ in call:
                break  # got the first token: the request is running
            call.cancel()
        t0 = time.monotonic()
        while True:
            c = (await ahealth(decode.address)).capacity
            if c.free_blocks == c.total_blocks and c.running == 0:
                return time.monotonic() - t0
            assert time.monotonic() - t0 < 1.0, c
            await asyncio.sleep(0.02)

    assert asyncio.run(start_and_cancel()) < 1.0


def test_a_silent_prefill_worker_fails_the_kv_clearly_and_frees(etcd, tmp_path, workers):
    """KV transfers follow their progress (issue 58): the decode worker gives up after
    --kv-timeout seconds without a word from the prefill worker — here P is stopped (SIGSTOP)
    mid-prompt — with DEADLINE_EXCEEDED, and every block is free once P runs again and
    confirms it writes no more."""
    prefill, _ = workers
    decode = WorkerProcess("decode", etcd.endpoint, "--kv-timeout", "1", log_dir=tmp_path)
    decode.wait_ready()
    prompt = [random.Random(2).randrange(100, 40000) for _ in range(2000)]

    async def run():
        call = asyncio.ensure_future(
            generate(decode.address, decode_request("silent", prompt, prefill))
        )
        await asyncio.sleep(0.3)  # P computes the prompt, 24 tokens a step
        os.kill(prefill.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            return err.value, time.monotonic() - t0
        finally:
            os.kill(prefill.pid, signal.SIGCONT)

    try:
        err, waited = asyncio.run(run())
        assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED, err
        assert "nothing from the prefill worker" in err.details() or "nothing from the sender" in (
            err.details()
        )
        assert waited < 15
        wait_all_blocks_free(decode.address)
        wait_all_blocks_free(prefill.address)
    finally:
        assert decode.terminate() == 0


def test_decode_worker_dying_mid_transfer_frees_the_prefill_worker(
    etcd, tmp_path, workers, reference_llm
):
    prefill, decode = workers
    # In the prefill worker's cluster: it writes only into registered workers.
    doomed = WorkerProcess("decode", etcd.endpoint, log_dir=tmp_path).wait_ready()
    long_prompt = [random.Random(4).randrange(100, 40000) for _ in range(3000)]

    async def start_then_kill():
        task = asyncio.create_task(
            generate(doomed.address, decode_request("doomed", long_prompt, prefill))
        )
        deadline = time.monotonic() + 20
        while (await ahealth(prefill.address)).capacity.running == 0:  # prefill under way
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        doomed.proc.kill()
        with pytest.raises(grpc.aio.AioRpcError):
            await task

    try:
        asyncio.run(start_then_kill())
    finally:
        doomed.kill()
    wait_all_blocks_free(prefill.address, timeout=15)  # aborted, pinned blocks released
    [prompt] = _prompts(1, seed=12)  # and it keeps serving
    responses = asyncio.run(
        generate(decode.address, decode_request("after-death", prompt, prefill))
    )
    [ref] = reference_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    assert {r.prefill_mode for r in responses} == {"remote"}
    assert tokens_by_index(responses)[0] == ref.outputs[0].token_ids


def test_cancel_mid_transfer_aborts_on_both_workers_and_frees(workers):
    prefill, decode = workers
    long_prompt = [random.Random(8).randrange(100, 40000) for _ in range(3000)]

    async def prefill_computes_it():
        return (await ahealth(prefill.address)).capacity.running > 0

    cancel_once_started(
        decode.address,
        decode_request("cancel-mid", long_prompt, prefill),
        prefill_computes_it,
        timeout=20,
    )
    # The decode side holds its blocks until the prefill side confirmed the abort (no late
    # write can land in reused blocks), then frees them; the prefill side frees its own.
    wait_all_blocks_free(decode.address, timeout=10)
    wait_all_blocks_free(prefill.address, timeout=10)
