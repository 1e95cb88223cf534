"""A real cluster for the OpenAI-client tests: etcd + `pdserve prefill` + `pdserve decode`
(2 layers, float32, 1 thread) + `pdserve router`, on free loopback ports, stopped by PID.
It runs authenticated as `pdserve up` runs: etcd with users (workers write, the router and
the tests read with the router's user) and a cluster token on every worker's gRPC port, so
the fuzz and conformance suites run with auth on.

Started once per session (tests/router/conftest.py) and shared by every module that asks for
it; a test may add routers of its own against the same etcd (`start_router`)."""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

from cluster.etcd_auth import etcd_users
from cluster.etcd_security import EtcdCredentials
from cluster.etcd_server import EtcdServer
from cluster.grpc_security import ClusterAuth, GrpcSecurity, resolve, write_token_file
from cluster.net import free_port
from cluster.registration import WorkerInfo, list_workers, make_client
from engine.flags import to_argv
from local_cluster.launcher import ServiceProcess

REPO = Path(__file__).resolve().parents[2]
NUM_LAYERS = 2
KEY = "sk-e2e-0123456789abcdef"
MODEL = "SmolLM2-135M-Instruct"
CLUSTER = "e2e"
WORKER_MAX_MODEL_LEN = 1024  # below the model's own 8192: the router learns it from etcd


@dataclass(frozen=True)
class Cluster:
    url: str  # the router's base URL
    etcd: str  # etcd endpoint
    logs: Path
    router_security: tuple[str, ...]
    """A router's flags for this cluster's etcd user and cluster token (`start_router`)."""
    etcd_credentials: EtcdCredentials
    """The router's etcd user: reads the registrations."""
    auth: ClusterAuth
    """What a direct gRPC call to a worker presents."""

    async def workers(self) -> list[WorkerInfo]:
        async with make_client(self.etcd, self.etcd_credentials) as client:
            return await list_workers(client, CLUSTER)


def workers_unavailable() -> str | None:
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pdserve", "decode", "--help"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`pdserve decode --help` failed: {exc!r}"
    return None if out.returncode == 0 else "`pdserve decode` is not available"


def reference_output(reference, token_ids: list[int], **sampling):
    """The single engine's RequestOutput for one prompt (`reference`: the conftest fixture)."""
    from engine import SamplingParams

    [out] = reference.generate([token_ids], SamplingParams(**sampling), use_tqdm=False)
    return out


@contextmanager
def start_router(
    etcd: str, logs: Path, *flags: str, security: tuple[str, ...], name: str = "router"
) -> Iterator[str]:
    """A router process on the cluster (`security`: Cluster.router_security); yields its URL
    once it sees both workers."""
    port = free_port()
    router = ServiceProcess(
        [
            "router",
            "--etcd",
            etcd,
            *security,
            "--cluster",
            CLUSTER,
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--enable-prompt-tokens-details",
            "--local-prefill-threshold",
            "0",
            "--local-prefill-max-tokens",
            "0",
            "--log-level",
            "warning",
            *flags,
        ],
        logs / f"{name}.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                h = httpx.get(url + "/health", timeout=2).json()
                if h.get("decode_workers") == 1 and h.get("prefill_workers") == 1:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or not router.alive():
                raise RuntimeError(
                    "router did not see both workers:\n" + router.log_path.read_text()[-3000:]
                )
            time.sleep(0.2)
        yield url
    finally:
        code = router.terminate(30)
    assert code == 0, f"{name} exited with {code}"


@contextmanager
def start_cluster(logs: Path) -> Iterator[Cluster]:
    users = etcd_users(CLUSTER, logs)
    token = GrpcSecurity(cluster_token_file=str(write_token_file(logs / "cluster-token")))
    with EtcdServer(auth=users.auth) as etcd:
        common = [
            "--etcd",
            etcd.endpoint,
            *to_argv(users.worker),
            *to_argv(token),
            "--cluster",
            CLUSTER,
        ]
        # float32 on both sides: `auto` is bfloat16 on CPUs with native bf16, and the
        # reference engine must compute exactly what the workers compute.
        worker_flags = [
            "--num-layers",
            str(NUM_LAYERS),
            "--kv-cache-memory",
            "64MiB",
            "--dtype",
            "float32",
            "--num-threads",
            "1",
            "--max-model-len",
            str(WORKER_MAX_MODEL_LEN),
        ]
        workers = {
            role: ServiceProcess(
                [role, *common, "--port", str(free_port()), *worker_flags], logs / f"{role}.log"
            )
            for role in ("prefill", "decode")
        }
        try:
            for w in workers.values():
                w.wait_ready()
            router_security = (*to_argv(users.router), *to_argv(token))
            with start_router(etcd.endpoint, logs, security=router_security) as url:
                yield Cluster(
                    url,
                    etcd.endpoint,
                    logs,
                    router_security,
                    users.router.resolve(),
                    resolve(token, {}),
                )
        finally:
            codes = {role: w.terminate(30) for role, w in workers.items()}
        assert codes == {"prefill": 0, "decode": 0}, codes
