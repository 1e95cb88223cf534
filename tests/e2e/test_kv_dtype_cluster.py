"""Quantized KV caches across real worker processes (etcd, NIXL on loopback): prefill and
decode workers both with `--kv-cache-dtype fp8` (int8), greedy outputs through a remote
prefill equal a single engine's with the same kv_cache_dtype exactly (the quantized blocks,
int8's scales inside them, travel byte for byte); a prefill worker of another KV format is
refused by name (FAILED_PRECONDITION naming both formats) and the decode worker prefills
locally instead."""

import asyncio
import random

import grpc
import pytest
from pd_cluster import (
    NUM_LAYERS,
    WorkerProcess,
    generate,
    metric,
    tokens_by_index,
    wait_all_blocks_free,
)

from cluster.etcd_server import EtcdServer
from cluster.registration import list_workers, make_client
from engine import LLM, SamplingParams
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

FORMATS = {"fp8": "fp8_e4m3", "int8": "int8"}  # flag -> normalized name (registration, hashes)


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server


@pytest.fixture(scope="module")
def cluster(etcd, tmp_path_factory):
    """A prefill and a decode worker per KV format, all in one cluster: {flag: (P, D)}."""
    logs = tmp_path_factory.mktemp("logs")
    procs = {
        kv: (
            WorkerProcess(
                "prefill",
                etcd.endpoint,
                "--kv-cache-dtype",
                kv,
                "--max-num-batched-tokens",
                "32",
                log_dir=logs,
            ),
            WorkerProcess(
                "decode", etcd.endpoint, "--kv-cache-dtype", kv, "--kv-timeout", "30", log_dir=logs
            ),
        )
        for kv in FORMATS
    }  # started together, waited for below
    try:
        yield {kv: (p.wait_ready(), d.wait_ready()) for kv, (p, d) in procs.items()}
    finally:
        for p, d in procs.values():
            assert d.terminate() == 0
            assert p.terminate() == 0


@pytest.fixture(scope="module")
def reference(model_dir):
    cache: dict[str, LLM] = {}

    def get(kv):
        if kv not in cache:
            cache[kv] = LLM(
                str(model_dir),
                num_layers=NUM_LAYERS,
                kv_cache_memory=32 << 20,
                dtype="float32",
                kv_cache_dtype=kv,
            )
        return cache[kv]

    return get


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(20, 120))] for _ in range(n)]


def _request(rid, tokens, prefill=None):
    req = pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=12),
    )
    if prefill is not None:
        req.prefill_worker.CopyFrom(prefill.ref())
    return req


def test_workers_publish_their_kv_format(etcd, cluster):
    async def listing():
        async with make_client(etcd.endpoint) as client:
            return await list_workers(client, "default")

    infos = {i.worker_id: i for i in asyncio.run(listing())}
    for kv, (p, d) in cluster.items():
        assert infos[p.worker_id].kv_cache_dtype == infos[d.worker_id].kv_cache_dtype == FORMATS[kv]
        assert infos[p.worker_id].compat_hash == infos[d.worker_id].compat_hash
    assert cluster["fp8"][0].worker_id != cluster["int8"][0].worker_id
    assert (
        infos[cluster["fp8"][0].worker_id].compat_hash
        != infos[cluster["int8"][0].worker_id].compat_hash
    )


@pytest.mark.parametrize("kv", list(FORMATS))
def test_disaggregated_greedy_equals_single_engine_with_the_same_kv_dtype(cluster, reference, kv):
    prefill, decode = cluster[kv]
    prompts = _prompts(4, seed=len(kv))
    before = metric(decode.metrics_address, "pdserve_kv_transfer_blocks_total", direction="receive")

    async def run_all():
        return await asyncio.gather(
            *[
                generate(decode.address, _request(f"{kv}-{i}", p, prefill))
                for i, p in enumerate(prompts)
            ]
        )

    results = asyncio.run(run_all())
    expected = reference(kv).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
    )
    for responses, ref in zip(results, expected):
        assert {r.prefill_mode for r in responses} == {"remote"}
        assert tokens_by_index(responses)[0] == ref.outputs[0].token_ids
    landed = (
        metric(decode.metrics_address, "pdserve_kv_transfer_blocks_total", direction="receive")
        - before
    )
    assert landed == sum(-(-len(p) // 16) for p in prompts)
    wait_all_blocks_free(prefill.address)
    wait_all_blocks_free(decode.address)


def test_prefill_worker_of_another_kv_format_is_refused_by_name(cluster, etcd):
    """P (int8) asked to write into D (fp8): refused before anything moves."""
    p_int8, _ = cluster["int8"]
    _, d_fp8 = cluster["fp8"]

    async def d_metadata():
        async with make_client(etcd.endpoint) as client:
            [info] = [
                i for i in await list_workers(client, "default") if i.worker_id == d_fp8.worker_id
            ]
        return info.kv_metadata.encode("ascii")

    request = pb.PrefillRequest(
        request_id="mismatch",
        prompt_token_ids=list(range(100, 132)),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=1, seed=1),
        destination=pb.KVDestination(
            peer_metadata=asyncio.run(d_metadata()),
            block_ids=[0, 1],
            transfer_id="mismatch:0",
            deadline_s=5,
        ),
    )

    async def call():
        async with grpc.aio.insecure_channel(p_int8.address) as ch:
            return await pb_grpc.PrefillWorkerStub(ch).Prefill(request, timeout=30)

    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(call())
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    details = e.value.details()
    assert "kv_cache_dtype: ours='int8' theirs='fp8_e4m3'" in details
    assert "ours int8 (int8, scales: per-token-head:float32-after-head_dim)" in details
    assert "theirs fp8_e4m3 (float8_e4m3fn, scales: unit)" in details
    wait_all_blocks_free(p_int8.address)
    # P's peer warm-up (etcd listing every second) said so once, not every second
    warm = [
        line
        for line in p_int8.log_path.read_text().splitlines()
        if f"worker {d_fp8.worker_id} is not a KV peer" in line
    ]
    assert len(warm) == 1 and "KV cache formats differ" in warm[0]


def test_decode_worker_prefills_locally_when_its_prefill_worker_is_of_another_format(
    cluster, reference
):
    """The existing fallback for a failing P (docs/workers.md): the request still succeeds,
    prefilled by D itself, and equals the single fp8 engine's output."""
    p_int8, _ = cluster["int8"]
    _, d_fp8 = cluster["fp8"]
    [prompt] = _prompts(1, seed=11)
    before = metric(d_fp8.metrics_address, "pdserve_kv_transfer_blocks_total", direction="receive")
    responses = asyncio.run(generate(d_fp8.address, _request("fallback", prompt, p_int8)))
    assert {r.prefill_mode for r in responses} == {"local_fallback"}
    [ref] = reference("fp8").generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
    )
    assert tokens_by_index(responses)[0] == ref.outputs[0].token_ids
    assert (
        metric(d_fp8.metrics_address, "pdserve_kv_transfer_blocks_total", direction="receive")
        == before
    )
    log = d_fp8.log_path.read_text()
    assert "FAILED_PRECONDITION" in log and "KV cache formats differ" in log
    wait_all_blocks_free(d_fp8.address)


def test_pdserve_up_kv_cache_dtype_reaches_both_roles_and_serves(tmp_path, reference):
    """`pdserve up --kv-cache-dtype int8`: both roles run int8 KV, the router places the
    prompt remotely (hashing with the workers' format), the output equals a single int8
    engine's."""
    import httpx
    from up_cluster import Up

    up = Up(
        tmp_path,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--kv-cache-dtype",
        "int8",
        "--router-arg=--local-prefill-threshold=0",
        "--router-arg=--local-prefill-max-tokens=0",
    )
    try:
        workers = up.workers()
        assert sorted(w.role for w in workers) == ["decode", "prefill"]
        assert {w.kv_cache_dtype for w in workers} == {"int8"}
        [decode] = [w for w in workers if w.role == "decode"]
        [prompt] = _prompts(1, seed=21)
        r = httpx.post(
            up.url + "/v1/completions",
            timeout=120,
            json={
                "model": "SmolLM2-135M-Instruct",
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0.0,
            },
        )
        assert r.status_code == 200, r.text
        [ref] = reference("int8").generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False
        )
        assert r.json()["choices"][0]["text"] == ref.outputs[0].text
        assert metric(
            decode.metrics_address, "pdserve_kv_transfer_blocks_total", direction="receive"
        ) == -(-len(prompt) // 16)
    finally:
        assert up.stop() == 0
