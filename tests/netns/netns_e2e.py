"""Real `pdserve` workers and etcd inside the emulated hosts' namespaces (see netns_util).

Each process is started through `ip netns exec` (which execs it: its PID is the process's own)
and stopped by that PID. Workers listen on their host's veth address and run UCX on TCP over
that veth only (`Host.ucx_env`), with UCX_PROTO_INFO=y so their logs name the transports."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path

from netns_util import Host
from pd_cluster import NUM_LAYERS, generate

from cluster.etcd_server import etcd_binary
from local_cluster.launcher import ServiceProcess

ETCD_PORT = 2379  # the namespaces are ours: every port is free


class NetnsWorker(ServiceProcess):
    """`pdserve prefill|decode` in `host`'s namespace with pd_cluster.WorkerProcess's test
    settings, gRPC and /metrics on the host's veth address."""

    def __init__(self, host: Host, role: str, etcd_endpoint: str, *extra: str, log_dir: Path):
        self.host, self.role = host, role
        self.args = [
            role,
            "--etcd",
            etcd_endpoint,
            "--host",
            host.addr,
            "--port",
            "0",
            "--num-layers",
            str(NUM_LAYERS),
            "--kv-cache-memory",
            "32MiB",
            "--num-threads",
            "1",
            "--dtype",
            "float32",
            *extra,
        ]
        self.log_path = log_dir / f"{role}-{host.netns}-{secrets.token_hex(2)}.log"
        self.log = open(self.log_path, "a", buffering=1)
        # ServiceProcess.__init__ would start `python -m pdserve` here, in our namespace.
        self.proc = subprocess.Popen(
            host.exec_argv(sys.executable, "-m", "pdserve", *self.args),
            env={**os.environ, **host.ucx_env(), "UCX_PROTO_INFO": "y"},
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
        )
        self.worker_id = self.grpc_address = self.metrics_address = ""
        self._ready = threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True).start()

    @property
    def address(self) -> str:
        return self.grpc_address


class NetnsEtcd:
    """etcd in `host`'s namespace, clients on its veth address, data in `data_dir`."""

    def __init__(self, host: Host, data_dir: Path) -> None:
        self.endpoint = f"{host.addr}:{ETCD_PORT}"
        client, peer = f"http://{self.endpoint}", "http://127.0.0.1:2380"
        self.proc = subprocess.Popen(
            host.exec_argv(
                str(etcd_binary()),
                "--name",
                "pdserve",
                "--data-dir",
                str(data_dir),
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"pdserve={peer}",
                "--log-level",
                "warn",
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


async def generate_all(address: str, requests: list) -> list:
    """Every request's responses, the requests sent concurrently (run in a client child)."""
    return await asyncio.gather(*[generate(address, r) for r in requests])
