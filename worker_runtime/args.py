"""The configuration `pdserve prefill` and `pdserve decode` share (beside EngineConfig); its
flags come from the fields (engine.flags)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.etcd_security import GROUP as ETCD_GROUP
from cluster.etcd_security import EtcdSecurity
from cluster.grpc_security import GROUP as GRPC_SECURITY_GROUP
from cluster.grpc_security import GrpcSecurity
from cluster.roles import Role
from engine.checks import check_fields
from engine.flags import option


@dataclass(frozen=True)
class WorkerConfig:
    role: Role = option(cli=False)
    """The role served at start: the subcommand, not a flag (Worker.SetRole switches it
    later)."""
    etcd: str = option(metavar="HOST:PORT")
    """etcd endpoint host:port."""
    etcd_security: EtcdSecurity = option(default_factory=EtcdSecurity, group=ETCD_GROUP)
    """How the worker authenticates to etcd: a user that may write the cluster's keys, TLS."""
    cluster: str = "default"
    """Cluster name (etcd key prefix); router and workers of one cluster share it."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 0
    """gRPC port (0: pick a free one)."""
    metrics_port: int = 0
    """Prometheus /metrics HTTP port (0: pick a free one)."""
    worker_id: str = ""
    """Unique id in the cluster ('': role-host-port)."""
    advertise_host: str = ""
    """Host other processes use to reach this worker ('': same as --host)."""
    kv_timeout_s: float = option(30.0, name="--kv-timeout")
    """Decode role: seconds without a word from the prefill worker (a block batch or a
    keepalive) after which its prompt's KV is given up on — a progress window, not a
    deadline: a long prompt on a slow prefill worker takes what it takes."""
    strict_remote_prefill: bool = False
    """Decode role: fail with UNAVAILABLE instead of prefilling locally when the prefill
    worker fails."""
    drain_timeout_s: float = option(30.0, name="--drain-timeout")
    """On SIGTERM: seconds to finish in-flight requests before exiting; also a role switch's
    drain when its SetRole names none."""
    num_threads: int = 0
    """torch threads for this process (0: cores / 2, at least 1): its own share of the host's
    cores."""
    share_host_cores: bool = False
    """Workers on one host lend each other their idle cores: a step uses this worker's
    --num-threads plus the threads of the host's workers that have no work at the time
    (worker_runtime/host_cores.py). Off by default: on a 2-core host it made decode ITL p50
    ~20% lower and TTFT ~20% higher at 1P+1D (docs/workers.md, "Threads")."""
    enable_admin_rpcs: bool = False
    """Serve the admin RPCs — Sleep, WakeUp, ResetPrefixCache, UpdateWeights, CollectiveRPC,
    LoadLoRAAdapter, UnloadLoRAAdapter, SetRole — to whoever can reach the gRPC port; without
    it they are PERMISSION_DENIED (the router's fleet admin, `pdserve role` and `up --planner`
    need it; `pdserve up` sets it when it runs them)."""
    allowed_model_paths: tuple[str, ...] = option((), metavar="DIR")
    """Directories that weights (UpdateWeights) and LoRA adapters (LoadLoRAAdapter, a
    request's adapter) must lie under, symlinks resolved; a path outside is PERMISSION_DENIED
    before it is opened. Empty: any path the worker's user can read."""
    itl_target_ms: float = 150.0
    """While requests decode, prefill chunks (prompts prefilled here) are sized from measured
    step costs so a step stays within this many ms, and a prompt cut is cut evenly; prefill
    still keeps at least 3/4 of a busy worker's time. 0: only --max-num-batched-tokens and
    --long-prefill-token-threshold size them."""
    kv_transfer_selftest: bool = True
    """At start, measure this worker's KV transfer path (temporary agents, a few MiB; about
    0.3 s) against a memcpy of the same bytes and name the transports UCX took; log it, warn
    when it is slow, export it on /metrics and publish it (`pdserve status` shows it;
    docs/kvtransfer.md, "Self-test at start"). --no-kv-transfer-selftest skips it (tests that
    start many workers)."""
    grpc_security: GrpcSecurity = option(default_factory=GrpcSecurity, group=GRPC_SECURITY_GROUP)
    """Who may call this worker's gRPC port (and what it presents to other workers): the
    cluster token and/or mutual TLS, as the router and every worker of the cluster
    (docs/security.md). Neither: the port is open to whoever reaches it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))
        check_fields(
            self,
            [
                (0 <= self.port < 65536, "port", "must be in 0..65535"),
                (0 <= self.metrics_port < 65536, "metrics_port", "must be in 0..65535"),
                (self.kv_timeout_s >= 0, "kv_timeout_s", "must be >= 0"),
                (self.drain_timeout_s >= 0, "drain_timeout_s", "must be >= 0"),
                (self.num_threads >= 0, "num_threads", "must be >= 0"),
                (self.itl_target_ms >= 0, "itl_target_ms", "must be >= 0"),
            ],
        )
