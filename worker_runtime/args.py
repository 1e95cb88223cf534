"""Command-line flags shared by `pdserve prefill` and `pdserve decode`."""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    """prefill | decode: the role served at start (Worker.SetRole switches it later)."""
    etcd: str
    """etcd endpoint host:port."""
    cluster: str = "default"
    """Namespace in etcd; router and workers of one cluster share it."""
    host: str = "127.0.0.1"
    port: int = 0
    """gRPC port (0: pick a free one)."""
    metrics_port: int = 0
    """Prometheus /metrics HTTP port (0: pick a free one)."""
    worker_id: str = ""
    """Unique id in the cluster ('': role-host-port)."""
    advertise_host: str = ""
    """Host other processes use to reach this worker ('': same as --host)."""
    kv_timeout_s: float = 30.0
    """Decode: how long to wait for a prompt's KV from a prefill worker."""
    strict_remote_prefill: bool = False
    """Decode: fail with UNAVAILABLE instead of prefilling locally when the prefill worker fails."""
    drain_timeout_s: float = 30.0
    """On SIGTERM: longest wait for in-flight requests before exiting; also a role switch's
    drain when its SetRole gives none."""
    num_threads: int = 0
    """torch threads for this process (0: cores / 2, at least 1)."""
    itl_target_ms: float = 0.0
    """While requests decode, prefill chunks (prompts prefilled here) are sized from measured
    step costs so a step stays within this; 0: only --max-num-batched-tokens and
    --long-prefill-token-threshold size them."""


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    d = WorkerConfig(role="", etcd="")
    g = parser.add_argument_group("worker")
    g.add_argument("--etcd", required=True, help="etcd endpoint host:port")
    g.add_argument("--cluster", default=d.cluster, help="cluster name (etcd key prefix)")
    g.add_argument("--host", default=d.host, help="address to listen on")
    g.add_argument("--port", type=int, default=d.port, help="gRPC port (0 = any free port)")
    g.add_argument("--metrics-port", type=int, default=d.metrics_port,
                   help="Prometheus /metrics port (0 = any free port)")
    g.add_argument("--worker-id", default=d.worker_id, help="unique id (default role-host-port)")
    g.add_argument("--advertise-host", default=d.advertise_host,
                   help="host others use to reach this worker (default: --host)")
    g.add_argument("--kv-timeout", dest="kv_timeout_s", type=float, default=d.kv_timeout_s,
                   help="decode role: seconds to wait for a prompt's KV from a prefill worker")
    g.add_argument("--strict-remote-prefill", action="store_true",
                   help="decode role: fail (UNAVAILABLE) rather than prefill locally when the prefill worker fails")
    g.add_argument("--drain-timeout", dest="drain_timeout_s", type=float, default=d.drain_timeout_s,
                   help="seconds to finish in-flight work after SIGTERM (and before a role "
                        "switch that names no drain timeout of its own)")
    g.add_argument("--num-threads", type=int, default=d.num_threads,
                   help="torch threads (0 = half the cores, at least 1)")
    g.add_argument("--itl-target-ms", type=float, default=d.itl_target_ms,
                   help="while requests decode, size prefill chunks from measured step costs so "
                        "a step stays within this many ms (0 = off)")


def worker_config_from_args(role: str, args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        role=role, etcd=args.etcd, cluster=args.cluster, host=args.host, port=args.port,
        metrics_port=args.metrics_port, worker_id=args.worker_id, advertise_host=args.advertise_host,
        kv_timeout_s=args.kv_timeout_s, strict_remote_prefill=args.strict_remote_prefill,
        drain_timeout_s=args.drain_timeout_s, num_threads=args.num_threads,
        itl_target_ms=args.itl_target_ms,
    )
