"""`pdserve up` end to end with the official openai client: concurrent streaming chats,
scale-out and scale-in under load with zero failed requests, a decode worker SIGKILLed under
load, and nothing left running after SIGTERM."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest

from cluster.registration import list_workers, make_client

pytestmark = pytest.mark.slow

WORKER_FLAGS = ["--worker-arg=--num-layers=2", "--worker-arg=--kv-cache-memory=64MiB",
                "--worker-arg=--dtype=float32"]


class Up:
    def __init__(self, tmp_path, *flags):
        self.env = {**os.environ, "PDSERVE_CACHE": str(tmp_path / "cache"), "UCX_NET_DEVICES": "lo"}
        os.makedirs(self.env["PDSERVE_CACHE"], exist_ok=True)
        model = subprocess.run([sys.executable, "-m", "pdserve", "prepare-model"], capture_output=True,
                               text=True, check=True, env={**os.environ}).stdout.strip()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "up", "--port", "0", "--model", model, "--num-threads", "1",
             "--log-dir", str(tmp_path / "logs"), *WORKER_FLAGS, *flags],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.url = None
        self.output: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.output.append(line)
                if line.startswith("pdserve is up: "):
                    self.url = line.split()[3]
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(240):
            self.stop()
            raise RuntimeError("pdserve up did not start:\n" + "".join(self.output[-50:]))
        self.run = json.loads((tmp_path / "cache" / "run" / "current-cluster.json").read_text())

    def cli(self, *args) -> str:
        return subprocess.run([sys.executable, "-m", "pdserve", *args], env=self.env, capture_output=True,
                              text=True, check=True, timeout=300).stdout

    def children(self) -> dict:
        return json.loads(urllib.request.urlopen(self.run["control"], timeout=5).read())

    def workers(self):
        async def fetch():
            async with make_client(self.run["etcd"]) as client:
                return await list_workers(client, self.run["cluster"])
        return asyncio.run(fetch())

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return -9


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


async def _chat(client, i: int) -> str:
    stream = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct", stream=True, max_tokens=16, temperature=0,
        messages=[{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"}],
    )
    text = ""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    return text


class Load:
    """Streaming chats in a loop from a background thread; counts successes and failures."""

    def __init__(self, url: str, concurrency: int = 4):
        self.ok, self.failed, self.errors = 0, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main(url, concurrency)), daemon=True)
        self._thread.start()

    async def _main(self, url, concurrency):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

        async def worker(w):
            i = 0
            while not self._stop.is_set():
                i += 1
                try:
                    await _chat(client, w * 1000 + i)
                    self.ok += 1
                except Exception as exc:
                    self.failed += 1
                    self.errors.append(repr(exc))

        await asyncio.gather(*[worker(w) for w in range(concurrency)])

    def stop(self):
        self._stop.set()
        self._thread.join(120)


def test_up_serves_scales_survives_a_kill_and_leaves_nothing(tmp_path):
    up = Up(tmp_path, "--prefill", "1", "--decode", "1")
    pids = set()
    try:
        async def concurrent():
            client = openai.AsyncOpenAI(base_url=up.url + "/v1", api_key="none", max_retries=0)
            return await asyncio.gather(*[_chat(client, i) for i in range(6)])

        assert all(isinstance(t, str) and t for t in asyncio.run(concurrent()))
        pids |= {p for ps in up.children().values() for p in ps}
        assert {"prefill", "decode", "router", "etcd"} <= {k for k, v in up.children().items() if v}

        # Scale out under load: the new decode worker starts receiving requests.
        load = Load(up.url)
        time.sleep(2)
        up.cli("scale", "decode", "+1")
        pids |= {p for ps in up.children().values() for p in ps}
        new = max(up.workers(), key=lambda w: w.worker_id if w.role == "decode" else "")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            metrics = urllib.request.urlopen(f"http://{new.metrics_address}/metrics", timeout=5).read().decode()
            served = [l for l in metrics.splitlines() if l.startswith("pdserve_worker_generation_tokens_total")]
            if served and float(served[0].split()[-1]) > 0:
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the added decode worker never received a request")

        # Scale in under load: the drained worker finishes its requests; nothing fails.
        up.cli("scale", "decode", "-1")
        time.sleep(6)
        load.stop()
        assert load.failed == 0, load.errors[:3]
        assert load.ok > 0
        assert len([w for w in up.workers() if w.role == "decode"]) == 1

        # SIGKILL a decode worker under load: only what it held fails; the cluster keeps serving.
        up.cli("scale", "decode", "+1")
        pids |= {p for ps in up.children().values() for p in ps}
        load = Load(up.url)
        time.sleep(3)
        victim = up.children()["decode"][-1]
        os.kill(victim, signal.SIGKILL)
        time.sleep(8)
        load.stop()
        assert load.failed <= 4, load.errors[:5]  # at most what the victim held (concurrency 4)
        assert load.ok > 0
        assert asyncio.run(concurrent())
    finally:
        code = up.stop()
    assert code == 0, "".join(up.output[-30:])
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "pdserve up left processes behind"
    assert not (tmp_path / "cache" / "run" / "current-cluster.json").exists()
