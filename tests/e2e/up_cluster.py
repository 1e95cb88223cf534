"""`pdserve up` as a test fixture: start it as a user would (its own PDSERVE_CACHE, free ports,
the 2-layer fp32 test model), read its control port and etcd, stop it with SIGTERM; plus a
streaming-chat load generator and a PID liveness check."""

import asyncio
import os
import subprocess
import sys
import threading
import time

import openai

from cluster.registration import list_workers, make_client
from local_cluster.launcher import UpProcess
from local_cluster.run_file import etcd_credentials

WORKER_FLAGS = [
    "--worker-arg=--num-layers=2",
    "--worker-arg=--kv-cache-memory=64MiB",
    "--worker-arg=--dtype=float32",
]


class Up(UpProcess):
    """`pdserve up` with the test settings, plus the CLI, slots and etcd views tests read."""

    def __init__(self, tmp_path, *flags):
        super().__init__(
            tmp_path,
            "--num-threads",
            "1",
            "--log-dir",
            str(tmp_path / "logs"),
            *WORKER_FLAGS,
            *flags,
            timeout=240,
        )

    def cli(self, *args) -> str:
        return subprocess.run(
            [sys.executable, "-m", "pdserve", *args],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        ).stdout

    def children(self) -> dict:
        """Live child PIDs by role (the control port's GET)."""
        return self.control()["pids"]

    def slots(self) -> dict:
        """The supervisor's slots by name: role, pid, state, restarts, last_exit."""
        return {s["name"]: s for s in self.control()["slots"]}

    def wait_slot(self, name: str, state: str, timeout: float = 120.0, restarts: int = 0) -> dict:
        """Poll until slot `name` is in `state` with at least `restarts` restarts."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            slot = self.slots().get(name)
            if slot and slot["state"] == state and slot["restarts"] >= restarts:
                return slot
            time.sleep(0.1)
        raise AssertionError(
            f"{name} not {state} within {timeout}s: {self.slots()}\n" + "".join(self.output[-30:])
        )

    def workers(self):
        async def fetch():
            async with make_client(self.run["etcd"], etcd_credentials(self.run)) as client:
                return await list_workers(client, self.run["cluster"])

        return asyncio.run(fetch())


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
        model="SmolLM2-135M-Instruct",
        stream=True,
        max_tokens=16,
        temperature=0,
        messages=[{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"}],
    )
    text = ""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    return text


class Load:
    """Streaming chats in a loop from a background thread; counts successes and failures."""

    def __init__(self, url: str, concurrency: int = 4, api_key: str = "none"):
        self.ok, self.failed, self.errors = 0, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main(url, concurrency, api_key)), daemon=True
        )
        self._thread.start()

    async def _main(self, url, concurrency, api_key):
        client = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60
        )

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
