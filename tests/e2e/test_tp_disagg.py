"""Disaggregated serving between tensor-parallel workers of different sizes, through a real
router (docs/parallelism.md, "KV transfer between tensor-parallel sizes"): etcd + router +
worker A (-tp 2), B (-tp 1), later C (-tp 2), roles moved with SetRole so that the router has
one choice each time:

  1. A prefill (tp 2) -> B decode (tp 1)
  2. B prefill (tp 1) -> A decode (tp 2)       (C, tp 2, joins as decode meanwhile)
  3. C prefill (tp 2) -> A / C decode (tp 2)   (B stopped)
  4. A and C both decode (no prefill pool): a greedy stream on one of them loses a rank
     (SIGKILL) while it runs the request; the worker exits, the router migrates the request to the
     other, and the client's text is the single engine's.

Every phase: greedy tokens and logprobs equal a single engine's at tp 1, the decode worker
counted remote prefills (KV really moved), every block of every worker free afterwards; a
request cancelled mid-transfer between tp-2 workers leaks nothing on either side."""

import asyncio
import json
import os
import random
import signal
import threading
import time

import grpc
import httpx
import pytest
from pd_cluster import (
    NUM_LAYERS,
    WorkerProcess,
    ahealth,
    cancel_once_started,
    health,
    metric,
    rank_children,
    wait_all_blocks_free,
    wait_router_sees,
)

from cluster.etcd_server import EtcdServer
from cluster.net import free_port
from engine import LLM, SamplingParams
from local_cluster.launcher import ServiceProcess
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

CLUSTER = "tp-disagg"
TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank, and then the fox "
    "ran into the forest where the trees were tall and old, and",
    "Once upon a time in a small village by the sea there lived an old fisherman who",
]
MAX_TOKENS = 5
MIGRATED_TOKENS = 160  # a rank dies a few tokens into this stream
TP2 = ("-tp", "2", "--distributed-timeout", "30", "--enable-admin-rpcs")


def _completions(url: str, prompts: list[list[int]]) -> list[tuple[list[str], list[float]]]:
    out = []
    with httpx.Client(timeout=120) as client:
        for prompt in prompts:
            r = client.post(
                url + "/v1/completions",
                json={
                    "model": "SmolLM2-135M-Instruct",
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "logprobs": 1,
                },
            )
            assert r.status_code == 200, r.text
            lp = r.json()["choices"][0]["logprobs"]
            out.append((lp["tokens"], lp["token_logprobs"]))
    return out


def _set_role(address: str, role: str) -> None:
    async def main():
        async with grpc.aio.insecure_channel(address) as ch:
            await pb_grpc.WorkerStub(ch).SetRole(pb.SetRoleRequest(role=role), timeout=60)

    asyncio.run(main())


def _remote(worker: WorkerProcess) -> float:
    return metric(worker.metrics_address, "pdserve_worker_prefill_mode_total", mode="remote")


def _check(url, prompts, expected, decoders, workers):
    before = sum(_remote(d) for d in decoders)
    got = _completions(url, prompts)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected):
        assert "".join(tokens) == "".join(want_tokens)
        assert logprobs == pytest.approx(want_logprobs, abs=2e-4)
    assert sum(_remote(d) for d in decoders) == before + len(prompts)  # KV moved every time
    for w in workers:
        wait_all_blocks_free(w.address, timeout=10)


def _cancel_mid_transfer(prefill: WorkerProcess, decode: WorkerProcess) -> None:
    long_prompt = [random.Random(8).randrange(100, 40000) for _ in range(3000)]
    request = pb.GenerateRequest(
        request_id="cancel-mid",
        prompt_token_ids=long_prompt,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        prefill_worker=prefill.ref(),
    )

    async def started():  # D parked it (waiting for KV) or P computes it
        d, p = await asyncio.gather(ahealth(decode.address), ahealth(prefill.address))
        return bool(d.capacity.waiting or d.capacity.running or p.capacity.running)

    cancel_once_started(decode.address, request, started)
    wait_all_blocks_free(decode.address, timeout=15)
    wait_all_blocks_free(prefill.address, timeout=15)


def _a_rank_dies_mid_stream(
    url: str, decoders: list[WorkerProcess], prompt: list[int], want_text: str
) -> WorkerProcess:
    """Stream a greedy completion (in a thread); as soon as a decode worker reports it running,
    SIGKILL that worker's rank 1. Returns that worker (it must exit 1); asserts the stream
    completed without an error and with `want_text`. The kill keys on the worker's state, not
    on the client's reading of the stream, which may lag the generation on a loaded host."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": prompt,
        "max_tokens": MIGRATED_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    text, errors = [], []

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    (errors if "error" in event else text).append(event)

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    while (
        killed := next((w for w in decoders if health(w.address).capacity.running), None)
    ) is None:
        assert time.monotonic() < deadline, "no decode worker ran the request"
        time.sleep(0.005)
    ranks = rank_children(killed.pid)
    assert len(ranks) == 1
    os.kill(ranks[0], signal.SIGKILL)
    reader.join(120)
    assert not reader.is_alive() and not errors, errors
    assert "".join(e["choices"][0]["text"] for e in text) == want_text
    return killed


def test_prefill_and_decode_at_different_tensor_parallel_sizes(model_dir, tmp_path):
    reference = LLM(
        str(model_dir), num_layers=NUM_LAYERS, kv_cache_memory=32 << 20, dtype="float32"
    )
    prompts = [reference.tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    expected = [
        ([reference.tokenizer.decode([t]) for t in c.token_ids], [lp.logprob for lp in c.logprobs])
        for c in (out.outputs[0] for out in reference.generate(prompts, params, use_tqdm=False))
    ]
    migrated = reference.generate(
        prompts[:1],
        SamplingParams(temperature=0.0, max_tokens=MIGRATED_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    want_migrated = migrated[0].outputs[0].text
    del reference
    with EtcdServer() as etcd:
        a = WorkerProcess("prefill", etcd.endpoint, *TP2, log_dir=tmp_path, cluster=CLUSTER)
        b = WorkerProcess(
            "decode", etcd.endpoint, "--enable-admin-rpcs", log_dir=tmp_path, cluster=CLUSTER
        )
        port = free_port()
        router = ServiceProcess(
            [
                "router",
                "--etcd",
                etcd.endpoint,
                "--cluster",
                CLUSTER,
                "--port",
                str(port),
                "--local-prefill-threshold",
                "0",
                "--local-prefill-max-tokens",
                "0",
                "--log-level",
                "warning",
            ],
            tmp_path / "router.log",
        )
        url = f"http://127.0.0.1:{port}"
        c = None
        try:
            a.wait_ready()
            b.wait_ready()
            wait_router_sees(url, router, prefill=1, decode=1)
            _check(url, prompts, expected, [b], [a, b])  # 1. P2 -> D1
            c = WorkerProcess("decode", etcd.endpoint, *TP2, log_dir=tmp_path, cluster=CLUSTER)
            _set_role(a.address, "decode")
            _set_role(b.address, "prefill")
            c.wait_ready()
            wait_router_sees(url, router, prefill=1, decode=2)
            _check(url, prompts, expected, [a, c], [a, b, c])  # 2. P1 -> D2
            assert b.terminate(30) == 0
            _set_role(c.address, "prefill")
            wait_router_sees(url, router, prefill=1, decode=1)
            _check(url, prompts, expected, [a], [a, c])  # 3. P2 -> D2
            _cancel_mid_transfer(c, a)
            _check(url, prompts[:1], expected[:1], [a], [a, c])  # still serving
            _set_role(c.address, "decode")  # 4. a rank dies
            wait_router_sees(url, router, prefill=0, decode=2)
            router_metrics = url.removeprefix("http://")
            before = metric(router_metrics, "pdserve_router_migrations_total")
            dead = _a_rank_dies_mid_stream(url, [a, c], prompts[0], want_migrated)
            assert metric(router_metrics, "pdserve_router_migrations_total") == before + 1
            assert dead.proc.wait(30) == 1  # a lost rank fails the whole worker
            survivor = c if dead is a else a
            wait_all_blocks_free(survivor.address, timeout=10)
            [(tokens, _)] = _completions(url, prompts[:1])  # the survivor serves
            assert "".join(tokens) == "".join(expected[0][0])
        finally:
            codes = [p.terminate(30) for p in (router, a, b, *([c] if c else [])) if p.alive()]
    assert all(code == 0 for code in codes)
