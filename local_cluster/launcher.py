"""Child `pdserve` processes: started with their flags, ready when they print their READY line,
stopped by PID (never by name). Used by `pdserve up`, benchmarks and multi-process tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class ServiceProcess:
    """`python -m pdserve <args>`; stdout is scanned for `READY <role> <id> grpc=... metrics=...`
    and otherwise appended to `log_path` with the rest of its output."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self.log = open(log_path, "a", buffering=1)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", *args],
            env={
                **os.environ,
                "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
                **(env or {}),
            },
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
        )
        self.worker_id = ""
        self.grpc_address = ""
        self.metrics_address = ""
        self._ready = threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None  # stdout=PIPE
        for line in self.proc.stdout:
            if line.startswith("READY ") and not self._ready.is_set():
                fields = dict(f.split("=", 1) for f in line.split()[3:] if "=" in f)
                self.worker_id = line.split()[2]
                self.grpc_address = fields.get("grpc", "")
                self.metrics_address = fields.get("metrics", "")
                self._ready.set()
            self.log.write(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def ready(self) -> bool:
        """It printed its READY line (a worker: serving and registered in etcd)."""
        return self._ready.is_set()

    def wait_ready(self, timeout: float = 120.0) -> "ServiceProcess":
        """Block until the READY line; fail at once if the process exits first."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2) and self.alive() and time.monotonic() < deadline:
            pass
        if not self._ready.is_set() or not self.alive():
            self.kill()
            tail = self.log_path.read_text()[-3000:] if self.log_path.exists() else ""
            raise RuntimeError(f"`pdserve {' '.join(self.args[:1])}` did not become ready:\n{tail}")
        return self

    def terminate(self, timeout: float = 40.0) -> int:
        """SIGTERM (drain), then SIGKILL after `timeout`. Returns the exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = -9
        self.log.flush()
        return code

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)


class UpProcess:
    """A whole `pdserve up` as a child process (chaos runs, end-to-end tests): its own
    PDSERVE_CACHE under `home` (so its run file is never another `up`'s), the prepared default
    model, any port; ready once it prints its URL. Stopped with SIGTERM (it drains and stops
    its children), SIGKILL of its process group as a last resort."""

    def __init__(self, home: Path, *flags: str, timeout: float = 300.0) -> None:
        import json

        model = subprocess.run(
            [sys.executable, "-m", "pdserve", "prepare-model"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        self.env = {
            **os.environ,
            "PDSERVE_CACHE": str(home / "cache"),
            "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
        }
        os.makedirs(self.env["PDSERVE_CACHE"], exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "up", "--port", "0", "--model", model, *flags],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.output: list[str] = []
        self.url = ""
        up = threading.Event()
        threading.Thread(target=self._read, args=(up,), daemon=True).start()
        if not up.wait(timeout):
            self.stop()
            raise RuntimeError("pdserve up did not start:\n" + "".join(self.output[-50:]))
        self.run = json.loads((home / "cache" / "run" / "current-cluster.json").read_text())
        """The run file: pid, url, etcd, cluster, control, logs."""

    def _read(self, up: threading.Event) -> None:
        assert self.proc.stdout is not None  # stdout=PIPE
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith("pdserve is up: "):
                self.url = line.split()[3]
                up.set()

    def control(self) -> dict:
        """The control port's GET: {"pids": live child PIDs by role, "slots": [...]}."""
        import json

        from local_cluster.run_file import control_request

        return json.loads(control_request(self.run))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return -9
