"""`pdserve up` as a test fixture: start it as a user would (its own PDSERVE_CACHE, free ports,
the 2-layer fp32 test model), read its control port and etcd, stop it with SIGTERM; plus a
streaming-chat load generator and a PID liveness check."""
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

from cluster.registration import list_workers, make_client

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
        """Live child PIDs by role (the control port's GET)."""
        return self.control()["pids"]

    def slots(self) -> dict:
        """The supervisor's slots by name: role, pid, state, restarts, last_exit."""
        return {s["name"]: s for s in self.control()["slots"]}

    def control(self) -> dict:
        return json.loads(urllib.request.urlopen(self.run["control"], timeout=5).read())

    def wait_slot(self, name: str, state: str, timeout: float = 120.0, restarts: int = 0) -> dict:
        """Poll until slot `name` is in `state` with at least `restarts` restarts."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            slot = self.slots().get(name)
            if slot and slot["state"] == state and slot["restarts"] >= restarts:
                return slot
            time.sleep(0.1)
        raise AssertionError(f"{name} not {state} within {timeout}s: {self.slots()}\n"
                             + "".join(self.output[-30:]))

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


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


async def chat(client, i: int) -> str:
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
                    await chat(client, w * 1000 + i)
                    self.ok += 1
                except Exception as exc:
                    self.failed += 1
                    self.errors.append(repr(exc))

        await asyncio.gather(*[worker(w) for w in range(concurrency)])

    def stop(self):
        self._stop.set()
        self._thread.join(120)
