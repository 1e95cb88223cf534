"""Entry point shared by `pdserve prefill` and `pdserve decode`. It lives here, in the command
line, because it is the one place above both roles: it puts both `prefill_node`'s and
`decode_node`'s services on the worker (the command names the role served at start;
`Worker.SetRole` switches it, worker_runtime/roles.py), and neither they nor the runtime they
share (`worker_runtime`) import it back."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import MutableMapping

from cluster.grpc_security import resolve
from cluster.roles import Role
from engine.config import EngineConfig, add_engine_args
from engine.flags import add_flags, from_args
from worker_runtime.args import WorkerConfig

log = logging.getLogger(__name__)


def add_args(parser: argparse.ArgumentParser) -> None:
    """WorkerConfig's flags (group "worker") and EngineConfig's (group "engine")."""
    add_flags(parser, WorkerConfig, group="worker")
    add_engine_args(parser)


def run(role: Role, args: argparse.Namespace) -> int:
    """Both configs from the parsed flags (once) and the cluster token / TLS files they name
    (a refused one stops the start: exit 2), then serve until SIGTERM."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"
    )
    bounded_openmp_spinning(os.environ)  # before anything imports torch
    config = from_args(WorkerConfig, args, role=role)
    auth = resolve(config.grpc_security, os.environ)
    engine_config = engine_config_for_role(role, EngineConfig.from_args(args))
    refusal = tensor_parallel_refusal(role, config, engine_config)
    if refusal:
        print(f"pdserve {role}: error: {refusal}", file=sys.stderr)
        return 2
    etcd_credentials = config.etcd_security.resolve(os.environ)  # before any model loads
    return asyncio.run(_serve(config, engine_config, auth, etcd_credentials))


def tensor_parallel_refusal(
    role: Role, config: WorkerConfig, engine_config: EngineConfig
) -> str | None:
    """Why this worker cannot run at its tensor_parallel_size (None: it can). The engine's own
    refusals are EngineConfig's (engine/config.py); these are the worker's (docs/parallelism.md)."""
    if not engine_config.parallel:
        return None
    if config.share_host_cores:
        return (
            "--share-host-cores with --tensor-parallel-size > 1 is not supported (each rank "
            "has a fixed share of the worker's threads)"
        )
    return None


OPENMP_SPIN_COUNT = "10000"
"""libgomp's GOMP_SPINCOUNT for workers: how long an idle OpenMP thread spins before it sleeps."""


def bounded_openmp_spinning(env: MutableMapping[str, str]) -> None:
    """OpenMP threads that spin briefly, then sleep, at the end of a parallel region
    (`GOMP_SPINCOUNT=10000`), unless the environment names a policy (`OMP_WAIT_POLICY` or
    `GOMP_SPINCOUNT`). A worker shares its host with the router, its own gRPC threads and
    other workers (and, with --share-host-cores, their idle cores: worker_runtime/
    host_cores.py). With libgomp's
    default (long spins), a step whose threads lose a core for a moment waits for the
    descheduled one at each of a step's ~300 parallel regions: 13x slower decode steps beside
    one busy process; passive waits (sleep at once) cost nothing then but forfeit the second
    thread on an idle host (a KVM guest wakes a sleeping vCPU slowly). Measured (SmolLM2, bf16,
    2 threads, ITL at batch 1): quiet 25 ms (spin), 25 (10000), 37 (passive), 1 thread 35;
    beside a busy process 510 (spin), 78 (10000), 42 (passive), 1 thread 39 (docs/benchmarks/
    decode_profile.md); core sharing keeps workers off each other's cores. libgomp reads it when
    torch loads, so this runs first."""
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT


def engine_config_for_role(role: Role, engine_config: EngineConfig) -> EngineConfig:
    """Speculation runs on decode workers only: a prefill worker computes prompts and samples
    one token per request, so it would load a draft model it never uses. It drops a
    --speculative-config (users pass the same --worker-arg to both roles) with one warning;
    the config is still parsed first, so a malformed one fails here as on a decode worker.
    The engine is built once, for the role served at start: a worker started as prefill
    decodes without speculation after a switch (outputs are the same; speculation only
    changes speed), one started as decode keeps its drafter while it prefills."""
    if role != Role.PREFILL or engine_config.speculative_config is None:
        return engine_config
    log.warning(
        "prefill worker: ignoring --speculative-config (%s); speculative decoding runs "
        "on decode workers",
        engine_config.speculative_config.to_json(),
    )
    return dataclasses.replace(engine_config, speculative_config=None)


async def _serve(config, engine_config, auth, etcd_credentials) -> int:
    from decode_node.worker import DecodeWorker
    from prefill_node.worker import PrefillWorker
    from proto import pdserve_pb2_grpc as pb_grpc
    from worker_runtime.kv_export import KVExporter
    from worker_runtime.kv_pull import KVPuller
    from worker_runtime.peers import RegisteredPeers
    from worker_runtime.process import build_runtime, serve
    from worker_runtime.service import WorkerService
    from worker_runtime.wiring import room_contexts

    runtime = build_runtime(config, engine_config, auth, etcd_credentials)
    rooms = room_contexts(runtime)  # each room sees its own narrow context, not the runtime
    peers, puller = RegisteredPeers(rooms.peers), KVPuller(rooms.pull)
    # Decode first: `Worker.Abort` asks the decode side (its Generate streams) before the
    # prefill side, which aborts whatever the engine has under that id.
    decode = DecodeWorker(rooms.decode, puller)
    prefill = PrefillWorker(rooms.prefill, peers, puller)
    exporter = KVExporter(rooms.export, peers)

    def add(server) -> None:
        pb_grpc.add_WorkerServicer_to_server(WorkerService(rooms.service, exporter), server)
        pb_grpc.add_DecodeWorkerServicer_to_server(decode, server)
        pb_grpc.add_PrefillWorkerServicer_to_server(prefill, server)

    background = [asyncio.create_task(peers.warm_forever())]
    try:
        return await serve(runtime, add)
    finally:
        for task in background:
            task.cancel()
        sys.stdout.flush()


_HELP = {
    Role.PREFILL: "run a worker that starts in the prefill role (gRPC Prefill; streams KV blocks "
    "over NIXL; registers in etcd; `pdserve role` switches it)",
    Role.DECODE: "run a worker that starts in the decode role (gRPC Generate; receives KV over "
    "NIXL; registers in etcd; `pdserve role` switches it)",
}


def register(subparsers) -> None:
    """Add the `prefill` and `decode` subcommands (importing nothing heavy)."""
    for role, help_text in _HELP.items():
        p = subparsers.add_parser(role, help=help_text)
        add_args(p)
        p.set_defaults(func=lambda args, role=role: run(role, args))
