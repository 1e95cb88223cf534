"""Request migration with real processes: etcd + two `pdserve decode` workers + `pdserve
router`. Seeded streamed requests run; the decode worker serving most of them is SIGKILLed
after a few tokens; every client stream still completes, with exactly the text a single
engine produces for the same seed — zero failed requests. Prints the seam it measured."""

import threading
import time

import httpx
import pytest
from pd_cluster import NUM_LAYERS, WorkerProcess, health

from cluster.etcd_server import EtcdServer
from cluster.net import free_port
from engine import LLM, SamplingParams
from local_cluster.launcher import ServiceProcess

pytestmark = pytest.mark.slow

CLUSTER = "migration"
TEXTS = ["The weather today is", "My favourite food is", "In the beginning", "Dear diary,"]
MAX_TOKENS = 64  # each stream is killed after about 3 tokens: the rest come after the migration


def _sampling(i: int) -> dict:
    return {
        "temperature": 0.8,
        "top_p": 0.95,
        "seed": 1000 + i,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "frequency_penalty": 0.2,
    }


class _Stream(threading.Thread):
    """One streamed completion; its text, finish reason, usage, errors and chunk times."""

    def __init__(self, url: str, prompt: list[int], sampling: dict) -> None:
        super().__init__(daemon=True)
        self.body = {
            "model": "SmolLM2-135M-Instruct",
            "prompt": prompt,
            "stream": True,
            "stream_options": {"include_usage": True},
            **sampling,
        }
        self.url = url
        self.text, self.times, self.errors = [], [], []
        self.finish_reason = self.usage = None

    def run(self) -> None:
        import json

        with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.errors.append(event)
                elif event["choices"]:
                    self.times.append(time.monotonic())
                    self.text.append(event["choices"][0]["text"])
                    self.finish_reason = event["choices"][0]["finish_reason"] or self.finish_reason
                else:
                    self.usage = event["usage"]


def _router_metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_sigkill_mid_stream_migrates_without_a_seam(model_dir, tmp_path):
    reference = LLM(
        str(model_dir), num_layers=NUM_LAYERS, kv_cache_memory=32 << 20, dtype="float32"
    )
    prompts = [reference.tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    params = [SamplingParams(**_sampling(i)) for i in range(len(prompts))]
    expected = [o.outputs[0].text for o in reference.generate(prompts, params, use_tqdm=False)]
    with EtcdServer() as etcd:
        decodes = [
            WorkerProcess("decode", etcd.endpoint, log_dir=tmp_path, cluster=CLUSTER)
            for _ in range(2)
        ]
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
                "--log-level",
                "warning",
            ],
            tmp_path / "router.log",
        )
        url = f"http://127.0.0.1:{port}"
        victim = None
        try:
            for d in decodes:
                d.wait_ready()
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).json().get("decode_workers") == 2:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and router.alive(), "router not ready"
                time.sleep(0.2)

            streams = [_Stream(url, p, _sampling(i)) for i, p in enumerate(prompts)]
            for s in streams:
                s.start()
            while min(len(s.times) for s in streams) < 3:
                assert all(s.is_alive() for s in streams), "a stream ended before the kill"
                time.sleep(0.005)
            # Worker stats refresh every 0.2 s: wait until the snapshot counts every stream.
            snapshot_deadline = time.monotonic() + 10
            while True:
                caps = [health(d.address).capacity for d in decodes]
                running = [c.running + c.waiting for c in caps]
                if sum(running) == len(streams) or time.monotonic() > snapshot_deadline:
                    break
                time.sleep(0.05)
            assert sum(running) == len(streams), running
            victim = decodes[running.index(max(running))]
            victim.kill()  # SIGKILL
            killed_at = time.monotonic()
            for s in streams:
                s.join(120)

            for s, text in zip(streams, expected):
                assert not s.errors, s.errors
                assert "".join(s.text) == text
                assert s.finish_reason == "length"
                assert s.usage["completion_tokens"] == MAX_TOKENS
            migrated = _router_metric(url, "pdserve_router_migrations_total")
            assert migrated == max(running) >= 1
            assert _router_metric(url, "pdserve_router_migration_failures_total") == 0
            # The seam as clients saw it: the longest gap between chunks straddling the kill.
            gaps = sorted(
                max(
                    (b - a for a, b in zip(s.times, s.times[1:]) if a <= killed_at <= b),
                    default=0.0,
                )
                for s in streams
            )
            seam_sum = _router_metric(url, "pdserve_router_migration_seam_seconds_sum")
            print(
                f"\nmigrated {migrated:g} of {len(streams)} requests, failed 0; client gap "
                f"across the kill (s): {[round(g, 3) for g in gaps]}; router seam "
                f"(failure -> next token) mean {seam_sum / migrated:.3f} s"
            )
        finally:
            code = router.terminate(30)
            codes = [d.terminate(30) for d in decodes if d is not victim]
    assert code == 0 and codes == [0]
