"""Elastic roles with real processes: etcd + `pdserve prefill` P + `pdserve decode` D +
`pdserve router --enable-dev-endpoints` (every prompt prefilled remotely while a prefill
worker exists). Greedy requests run through the router the whole time; P is switched to
decode (router `POST /set_role`: the cluster then has no prefill worker and prompts are
prefilled locally) and back (`pdserve role`). Zero failed requests, every output equal to a
single engine's; P's etcd key moved both times; P is the same process with its prefix cache
(a prompt it prefilled before the switch hits its cache after it); a streamed request on a
worker whose drain times out is migrated by the router and completes exactly; finally the two swap
pools, so KV flows from the worker started as decode into the one started as prefill; no
KV block leaked. Also:
the role gate refuses the role not served, and a decode stream still running when the drain
times out ends with an "abort" update (what the router migrates)."""

import asyncio
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest
from pd_cluster import (
    NUM_LAYERS,
    WorkerProcess,
    generate,
    health,
    metric,
    wait_all_blocks_free,
    wait_router_sees,
)

from cluster.etcd_server import EtcdServer
from cluster.net import free_port
from cluster.registration import list_workers, make_client
from engine import LLM, SamplingParams
from local_cluster.launcher import ServiceProcess
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CLUSTER = "elastic"
TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank, and then",
    "Once upon a time in a small village by the sea there lived an old fisherman who",
    "The history of the printing press begins in the fifteenth century, when",
    "To make a good cup of tea, first boil fresh water, then warm the pot and",
]
MAX_TOKENS = 6
LONG = {"temperature": 0.8, "top_p": 0.95, "seed": 7, "max_tokens": 600, "ignore_eos": True}


class _Load(threading.Thread):
    """Greedy completions through the router, one after another, until stopped."""

    def __init__(self, url: str, prompts: list[list[int]], start: int = 0) -> None:
        super().__init__(daemon=True)
        self.url, self.prompts, self.first = url, prompts, start
        self.stop = threading.Event()
        self.paused = threading.Event()  # set by the test: send nothing for now
        self.idle = threading.Event()  # set by the thread: paused, nothing in flight
        self.results: list[tuple[int, int, str]] = []  # (prompt index, HTTP status, text or error)

    def run(self) -> None:
        i = self.first
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                if self.paused.is_set():
                    self.idle.set()
                    time.sleep(0.02)
                    continue
                self.idle.clear()
                k = i % len(self.prompts)
                r = client.post(
                    self.url + "/v1/completions",
                    json={
                        "model": "SmolLM2-135M-Instruct",
                        "prompt": self.prompts[k],
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0.0,
                        "ignore_eos": True,
                    },
                )
                self.results.append(
                    (
                        k,
                        r.status_code,
                        r.json()["choices"][0]["text"] if r.status_code == 200 else r.text,
                    )
                )
                i += 1

    def served_since(self, n: int, timeout: float = 60.0) -> None:
        """Wait until `n` more requests were answered."""
        target = len(self.results) + n
        deadline = time.monotonic() + timeout
        while len(self.results) < target:
            assert self.is_alive() and time.monotonic() < deadline, "load stalled"
            time.sleep(0.05)


class _LongStream(threading.Thread):
    """One streamed seeded completion through the router: its text, chunks and errors."""

    def __init__(self, url: str, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.text, self.errors, self.finish_reason = [], [], None

    def run(self) -> None:
        import json

        body = {"model": "SmolLM2-135M-Instruct", "prompt": self.prompt, "stream": True, **LONG}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.errors.append(event)
                    elif event["choices"]:
                        self.text.append(event["choices"][0]["text"])
                        self.finish_reason = (
                            event["choices"][0]["finish_reason"] or self.finish_reason
                        )


def _router_metric(url: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(url + "/metrics").text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


def _etcd_roles(endpoint: str) -> dict[str, list[str]]:
    """worker id -> the roles it is registered under in etcd (one key each)."""

    async def main():
        async with make_client(endpoint) as client:
            out: dict[str, list[str]] = {}
            for info in await list_workers(client, CLUSTER):
                out.setdefault(info.worker_id, []).append(info.role)
            return out

    return asyncio.run(main())


def _set_role(address: str, role: str, drain_timeout_s: float = 0.0) -> pb.SetRoleResponse:
    async def main():
        async with grpc.aio.insecure_channel(address) as ch:
            return await pb_grpc.WorkerStub(ch).SetRole(
                pb.SetRoleRequest(role=role, drain_timeout_s=drain_timeout_s), timeout=60
            )

    return asyncio.run(main())


def _local_generate(
    rid: str, prompt: list[int], max_tokens: int = MAX_TOKENS
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


def test_switching_roles_keeps_serving_and_keeps_the_engine(model_dir, tmp_path):
    reference = LLM(
        str(model_dir), num_layers=NUM_LAYERS, kv_cache_memory=32 << 20, dtype="float32"
    )
    prompts = [reference.tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    expected = [
        out.outputs[0].text
        for out in reference.generate(
            prompts,
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
            use_tqdm=False,
        )
    ]
    [long_expected] = reference.generate([prompts[3]], SamplingParams(**LONG), use_tqdm=False)
    long_expected = long_expected.outputs[0].text
    del reference
    with EtcdServer() as etcd:
        p = WorkerProcess(
            "prefill", etcd.endpoint, "--enable-admin-rpcs", log_dir=tmp_path, cluster=CLUSTER
        )
        d = WorkerProcess(
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
                "--enable-dev-endpoints",
                "--log-level",
                "warning",
            ],
            tmp_path / "router.log",
        )
        url = f"http://127.0.0.1:{port}"
        load = background = None
        try:
            p.wait_ready()
            d.wait_ready()
            wait_router_sees(url, router, prefill=1, decode=1)
            pid = p.pid
            load = _Load(url, prompts)  # the test waits on this one's progress
            background = _Load(url, prompts, start=2)  # two requests in flight at most
            load.start()
            background.start()
            load.served_since(len(prompts))  # every prompt prefilled on P once
            assert metric(d.metrics_address, "pdserve_worker_prefill_mode_total", mode="remote") > 0
            with pytest.raises(grpc.RpcError) as refused:  # P does not serve Generate
                asyncio.run(generate(p.address, _local_generate("gate", prompts[0])))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "serves the prefill role" in refused.value.details()

            # P -> decode through the router's dev endpoint.
            r = httpx.post(
                f"{url}/set_role", params={"worker_id": p.worker_id, "role": "decode"}, timeout=120
            )
            assert r.status_code == 200, r.text
            assert r.json() == {
                "worker_id": p.worker_id,
                "role": "decode",
                "previous_role": "prefill",
            }
            wait_router_sees(url, router, prefill=0, decode=2)
            assert _etcd_roles(etcd.endpoint) == {p.worker_id: ["decode"], d.worker_id: ["decode"]}
            assert health(p.address).role == "decode" and p.pid == pid and p.alive()
            load.served_since(2 * len(prompts))  # prefilled locally now: no prefill worker
            # P's engine and prefix cache were kept: a prompt it prefilled before hits it.
            responses = asyncio.run(generate(p.address, _local_generate("cached", prompts[1])))
            assert responses[-1].usage.cached_tokens > 0
            assert "".join(x.text for x in responses) == expected[1]
            # Idempotent; bad input is a 400 in OpenAI's shape; unknown workers a 404.
            assert _set_role(p.address, "decode").previous_role == "decode"
            bad = httpx.post(f"{url}/set_role", params={"worker_id": p.worker_id, "role": "both"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "role"
            assert (
                httpx.post(
                    f"{url}/set_role", params={"worker_id": "nobody", "role": "decode"}
                ).status_code
                == 404
            )

            # A stream P still runs when its drain times out ends with "abort" (the router
            # migrates such a stream to another decode worker: tests/e2e/test_migration.py).
            async def long_stream_then_switch():
                async with grpc.aio.insecure_channel(p.address) as ch:
                    call = pb_grpc.DecodeWorkerStub(ch).Generate(
                        _local_generate("long", prompts[2], max_tokens=4000), timeout=120
                    )
                    first = await call.read()
                    assert first.token_ids
                    switch = asyncio.ensure_future(
                        asyncio.to_thread(_set_role, p.address, "prefill", 0.3)
                    )
                    rest = []
                    while (message := await call.read()) is not grpc.aio.EOF:
                        rest.append(message)
                    return rest, await switch

            rest, reply = asyncio.run(long_stream_then_switch())
            assert rest[-1].finish_reason == "abort"
            assert reply.previous_role == "decode" and reply.role == "prefill"
            wait_router_sees(url, router, prefill=1, decode=1)
            # And back to decode, then prefill again, with the CLI.
            out = subprocess.run(
                [sys.executable, "-m", "pdserve", "role", "--worker", p.address, "decode"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert out.returncode == 0 and "prefill -> decode" in out.stdout, out.stderr
            wait_router_sees(url, router, prefill=0, decode=2)
            load.served_since(len(prompts))

            # A router stream still running on a worker whose drain times out is migrated to
            # the other decode worker: the client's stream completes, exactly.
            switches = {p.worker_id: 3, d.worker_id: 0}
            for thread in (load, background):
                thread.paused.set()
            for thread in (load, background):
                assert thread.idle.wait(60)
            stream = _LongStream(url, prompts[3])
            stream.start()
            deadline = time.monotonic() + 60
            seen, since = None, time.monotonic()
            while True:  # the stats snapshot (every 0.2 s) shows where the stream runs: trust
                # it once one worker alone has been busy across three refreshes (a stale
                # snapshot of the paused load must not pick the wrong victim)
                busy = tuple(w for w in (p, d) if health(w.address).capacity.running > 0)
                if busy != seen:
                    seen, since = busy, time.monotonic()
                if len(busy) == 1 and time.monotonic() - since >= 0.6 and len(stream.text) >= 3:
                    break
                assert stream.is_alive() and time.monotonic() < deadline, "stream not seen"
                time.sleep(0.05)
            [victim] = busy
            assert _set_role(victim.address, "prefill", 0.3).previous_role == "decode"
            stream.join(300)
            for thread in (load, background):
                thread.paused.clear()
            assert not stream.errors and stream.finish_reason == "length"
            assert "".join(stream.text) == long_expected
            assert _router_metric(url, "pdserve_router_migrations_total") >= 1
            assert _set_role(victim.address, "decode").previous_role == "prefill"
            switches[victim.worker_id] += 2
            wait_router_sees(url, router, prefill=0, decode=2)
            out = subprocess.run(
                [sys.executable, "-m", "pdserve", "role", "--worker", p.address, "prefill"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert out.returncode == 0 and "decode -> prefill" in out.stdout, out.stderr
            wait_router_sees(url, router, prefill=1, decode=1)
            assert _etcd_roles(etcd.endpoint) == {p.worker_id: ["prefill"], d.worker_id: ["decode"]}
            remote = metric(d.metrics_address, "pdserve_worker_prefill_mode_total", mode="remote")
            load.served_since(len(prompts))
            assert (
                metric(d.metrics_address, "pdserve_worker_prefill_mode_total", mode="remote")
                > remote
            )  # P prefills again
            # Swap the pools: D (started as decode) prefills and sends KV into P (started
            # as prefill), which decodes it.
            assert _set_role(p.address, "decode").previous_role == "prefill"
            assert _set_role(d.address, "prefill").previous_role == "decode"
            deadline = time.monotonic() + 60
            while (
                metric(p.metrics_address, "pdserve_worker_prefill_mode_total", mode="remote") == 0
            ):
                assert time.monotonic() < deadline, "no remote prefill from D into P"
                load.served_since(1)
            load.served_since(len(prompts))
            for thread in (load, background):
                thread.stop.set()
                thread.join(120)

            results = load.results + background.results
            failed = [x for x in results if x[1] != 200]
            assert not failed, failed[:3]
            assert all(text == expected[k] for k, _, text in results)
            assert p.pid == pid and p.alive()
            assert _etcd_roles(etcd.endpoint) == {p.worker_id: ["decode"], d.worker_id: ["prefill"]}
            assert metric(p.metrics_address, "pdserve_worker_role", role="decode") == 1
            assert metric(p.metrics_address, "pdserve_worker_role", role="prefill") == 0
            assert (
                metric(p.metrics_address, "pdserve_worker_role_switches_total")
                == switches[p.worker_id] + 2
            )
            assert (
                metric(d.metrics_address, "pdserve_worker_role_switches_total")
                == switches[d.worker_id] + 1
            )
            for w in (p, d):
                wait_all_blocks_free(w.address, timeout=10)
            print(
                f"\n{len(results)} requests + one migrated stream through "
                f"{sum(switches.values()) + 3} role switches, 0 failed"
            )
        finally:
            for thread in (load, background):
                if thread is not None:
                    thread.stop.set()
                    thread.join(120)
            codes = [w.terminate(30) for w in (router, d, p)]
    assert codes == [0, 0, 0]
