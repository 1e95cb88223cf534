"""`pdserve up`'s configuration: one frozen tree, parsed once (cli.py) and passed down. Its flags
come from the fields (engine.flags), and the workers' and the router's command lines are built
from configs of theirs (engine.flags.to_argv), so an engine flag reaches `up` and its workers
without an edit here."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from cluster.chat_config import GROUP as CHAT_GROUP
from cluster.chat_config import ChatConfig
from cluster.etcd_security import GROUP as ETCD_GROUP
from cluster.etcd_security import EtcdSecurity
from cluster.grpc_security import GROUP as GRPC_SECURITY_GROUP
from cluster.grpc_security import GrpcSecurity
from cluster.roles import Role
from engine.checks import FieldError, check_fields
from engine.config import EngineConfig
from engine.flags import option
from local_cluster.planner import PlannerConfig
from local_cluster.slots import RestartPolicy

PLANNER_GROUP = (
    "planner (docs/planner.md): move workers between the pools from measured load and SLOs"
)


@dataclass(frozen=True)
class UpConfig:
    prefill: int | None = option(None, metavar="N")
    """Prefill workers to start. Default: 1; 0 on a host with at most 2 cores (SMALL_HOST_CORES;
    unless --planner, which needs a worker of each role to move) and at
    --tensor-parallel-size > 1 (each worker is N processes) — one colocated decode worker with
    every core prefills on all of them where a prefill worker has a share
    (docs/benchmarks/serving.md: on 2 cores TTFT p99 0.82-1.19x vLLM-CPU's, against 1.28-1.64x for 1
    prefill + 1 decode worker)."""
    decode: int = 1
    """Decode workers to start."""
    host: str = "127.0.0.1"
    """Router listen address."""
    port: int = 8000
    """Router port (0: any free port, kept across restarts)."""
    etcd: str | None = option(None, metavar="HOST:PORT")
    """Use this etcd instead of starting one. The etcd `up` starts has auth enabled: root, a
    worker user that may write only this cluster's keys and a router user that may only read
    them, their random passwords in 0600 files in up's run directory."""
    etcd_security: EtcdSecurity = option(default_factory=EtcdSecurity, group=ETCD_GROUP)
    """With --etcd: the user and TLS every process of the cluster (workers, router, planner)
    authenticates to it with (the user must be able to write the cluster's keys)."""
    cluster: str = "default"
    """Cluster name in etcd."""
    num_threads: int = 0
    """torch threads per worker (0: cores / workers, at least 1)."""
    log_dir: str | None = None
    """Keep per-process logs here (default: a temp dir)."""
    restart: RestartPolicy = option(default_factory=RestartPolicy)
    """When a crashed process is restarted."""
    engine: EngineConfig = option(default_factory=EngineConfig, group="engine")
    """The engine of every worker, both roles (a prefill worker writes KV only into a decode
    worker's pool of the same format and applies the same LoRA adapter); flags left at their
    default are not passed. --speculative-config goes to decode workers only (prefill workers
    never speculate). --enable-lora and --lora-modules also go to the router (it serves the
    adapters as models and accepts /v1/load_lora_adapter and /v1/unload_lora_adapter);
    --enable-sleep-mode also gives the router --enable-dev-endpoints (fleet-wide /sleep,
    /wake_up, /is_sleeping, /reset_prefix_cache, /collective_rpc, /update_weights)."""
    planner: bool = option(False, group=PLANNER_GROUP)
    """Switch workers between prefill and decode in place (Worker.SetRole) when a pool misses
    its SLO or is the bottleneck; without it the pools stay as --prefill / --decode (and
    `pdserve scale`) set them."""
    planner_config: PlannerConfig = option(default_factory=PlannerConfig, group=PLANNER_GROUP)
    """The planner's SLOs, limits and timing."""
    worker_args: tuple[str, ...] = option((), name="--worker-arg", repeat=True, metavar="FLAG")
    """Extra flag for every worker, after the flags above, e.g.
    --worker-arg=--kv-timeout=5."""
    prefill_args: tuple[str, ...] = option((), name="--prefill-arg", repeat=True, metavar="FLAG")
    """Extra flag for prefill workers only (after the --worker-arg ones)."""
    decode_args: tuple[str, ...] = option((), name="--decode-arg", repeat=True, metavar="FLAG")
    """Extra flag for decode workers only (after the --worker-arg ones)."""
    chat: ChatConfig = option(default_factory=ChatConfig, group=CHAT_GROUP)
    """The router's chat flags (vLLM's): chat template, tool calling, reasoning."""
    router_args: tuple[str, ...] = option((), name="--router-arg", repeat=True, metavar="FLAG")
    """Extra flag for the router, e.g. --router-arg=--policy=round_robin. Keys never go on a
    command line (visible in `ps`): --api-key-file, or PDSERVE_API_KEY in the environment."""
    api_key_file: str | None = option(None, metavar="PATH")
    """The router's API keys, one per line (its --api-key-file); PDSERVE_API_KEY /
    VLLM_API_KEY in `up`'s environment reach the router as well."""
    admin_api_key_file: str | None = option(None, metavar="PATH")
    """The router's admin keys (its --admin-api-key-file); or PDSERVE_ADMIN_API_KEY."""
    generate_api_key: bool = False
    """Make a random API key for the router in a 0600 file of up's run directory (named in the
    banner and the run file; removed when `up` stops): only the users who can read it reach
    the model and the admin surface. Off by default: every local user of the host can then
    use a keyless router (browsers cannot: docs/security.md, "The HTTP edge")."""
    allowed_model_paths: tuple[str, ...] = option((), metavar="DIR")
    """More directories the workers may load weights (/update_weights) and LoRA adapters
    (/v1/load_lora_adapter, a request's adapter) from. Every worker gets --allowed-model-paths
    with the model's directory, each --lora-modules adapter's directory and these; a path
    outside them is refused before it is opened (docs/security.md)."""
    grpc_security: GrpcSecurity = option(default_factory=GrpcSecurity, group=GRPC_SECURITY_GROUP)
    """The cluster plane's authentication, given to the router, every worker and the planner.
    Without --cluster-token-file or PDSERVE_CLUSTER_TOKEN, `up` makes a random token for this
    cluster in a 0600 file of its run directory (named in the banner and the run file), so
    the workers' gRPC ports always need it. --tls-*: mutual TLS too (one certificate for
    every process: it must name the host the workers listen on, or --tls-server-name)."""

    def __post_init__(self) -> None:
        prefill = self.prefill
        if prefill is None:
            prefill = default_prefill_workers(self, host_cores())
            object.__setattr__(self, "prefill", prefill)
        on_argv = [
            a for a in self.router_args if a.split("=", 1)[0] in ("--api-key", "--admin-api-key")
        ]
        given = [
            f"--{k.replace('_', '-')}"
            for k, v in dataclasses.asdict(self.etcd_security).items()
            if v is not None
        ]
        if given and self.etcd is None:
            raise FieldError(
                "etcd_security",
                f"{' '.join(given)} apply to an etcd given with "
                "--etcd; the etcd `up` starts gets users of its own (generated "
                "passwords in 0600 files)",
            )
        check_fields(
            self,
            [
                (
                    not on_argv,
                    "router_args",
                    f"{on_argv[0].split('=', 1)[0] if on_argv else ''} "
                    "would put a key on the router's command line (visible in `ps`): use "
                    "--api-key-file / --admin-api-key-file or PDSERVE_API_KEY",
                ),
                (
                    not (self.generate_api_key and self.api_key_file),
                    "generate_api_key",
                    "is exclusive with --api-key-file (give a key, or have one made)",
                ),
                (prefill >= 0, "prefill", "must be >= 0"),
                (self.decode >= 0, "decode", "must be >= 0"),
                (0 <= self.port < 65536, "port", "must be in 0..65535"),
                (self.num_threads >= 0, "num_threads", "must be >= 0"),
            ],
        )

    def engine_for(self, role: Role) -> EngineConfig:
        """A `role` worker's engine: without speculation on a prefill worker (it computes
        prompts and samples one token per request; a draft model would go unused)."""
        if role == Role.PREFILL:
            return dataclasses.replace(self.engine, speculative_config=None)
        return self.engine

    @property
    def runs_admin_rpcs(self) -> bool:
        """Whether this cluster calls its workers' admin RPCs (--enable-admin-rpcs on every
        worker): the planner switches roles, --enable-sleep-mode gives the router the
        fleet-wide admin endpoints, --enable-lora its runtime adapter loading. Otherwise the
        workers refuse them (`--worker-arg=--enable-admin-rpcs` turns them on, e.g. for
        `pdserve role`)."""
        return self.planner or self.engine.enable_sleep_mode or self.engine.enable_lora

    @property
    def model_roots(self) -> tuple[str, ...]:
        """The workers' --allowed-model-paths: the model's directory (a GGUF file's folder),
        each --lora-modules adapter's directory, then --allowed-model-paths', absolute.
        `up` resolves the model (`default` -> its prepared folder) before asking."""
        model = Path(self.engine.model).expanduser()
        roots = [model.parent if model.suffix == ".gguf" or model.is_file() else model]
        roots += [Path(m.path).expanduser() for m in self.engine.lora_modules]
        roots += [Path(p).expanduser() for p in self.allowed_model_paths]
        return tuple(dict.fromkeys(str(p.absolute()) for p in roots))

    def role_args(self, role: Role) -> tuple[str, ...]:
        """--prefill-arg's or --decode-arg's."""
        return self.prefill_args if role == Role.PREFILL else self.decode_args


SMALL_HOST_CORES = 2
"""At most this many cores, `pdserve up` starts no prefill worker by default (UpConfig.prefill)."""


def host_cores() -> int:
    """The cores this process may run on (its affinity: taskset, a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_prefill_workers(config: UpConfig, cores: int) -> int:
    """UpConfig.prefill when not given: 1, or 0 where a split leaves each role too few cores
    (a small host without --planner), or with tensor parallelism (a worker is N processes:
    give --prefill to split them)."""
    if config.engine.parallel or (cores <= SMALL_HOST_CORES and not config.planner):
        return 0
    return 1
