"""The life cycle of a worker process, around its `WorkerRuntime` (runtime.py): build (load
model, size pool, register the pool with NIXL, measure it: `transfer_selftest`) -> start
(engine thread, gRPC server, metrics server, etcd registration; etcd unreachable at start is
fatal, and so, with exit code 2, is a registered worker of this KV layout that hashes blocks
differently: cluster/block_hash_agreement.py) -> serve -> SIGTERM: SHUTTING_DOWN (published
at once; new work is refused with UNAVAILABLE), wait for in-flight calls (bounded),
deregister, exit 0. If the engine loop dies (a step raised), every engine command fails at
once, the worker deregisters and the process exits 1, so its supervisor restarts it. The entry
point is pdserve/worker_main.py: `build_runtime`, the rooms' servicers (wiring.py), `serve`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from cluster.etcd_security import EtcdCredentials
from cluster.grpc_auth import add_port
from cluster.grpc_security import ClusterAuth
from cluster.heap import freeze_startup_heap
from cluster.registration import RegistrationRefused, TransferSelftest
from engine.llm_engine import LLMEngine
from worker_runtime.admission import WorkerPhase
from worker_runtime.args import WorkerConfig
from worker_runtime.host_cores import release_openmp_threads, worker_threads
from worker_runtime.kv_layout import rank_link
from worker_runtime.runtime import WorkerRuntime, make_grpc_server

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from kvtransfer.selftest import PeerFactory, SelftestResult

log = logging.getLogger(__name__)


def _exit_rank_failed(reason: str) -> None:
    """A tensor-parallel rank died: this worker cannot run its model; exit non-zero at once so
    that its supervisor (`pdserve up`) restarts it (its etcd lease lapses)."""
    log.error("%s: exiting", reason)
    logging.shutdown()
    os._exit(1)


def build_runtime(
    config: WorkerConfig,
    engine_config: EngineConfig,
    auth: ClusterAuth,
    etcd_credentials: EtcdCredentials | None = None,
) -> WorkerRuntime:
    """The production runtime: the engine, a NIXL agent, an etcd registration."""
    from cluster.block_hash_agreement import check_peers
    from cluster.registration import Registrar
    from kvtransfer import KVTransferConfig
    from kvtransfer.nixl_backend import NixlTransferBackend
    from kvtransfer.selftest import nixl_peer

    step_threads = worker_threads(config.num_threads, config.share_host_cores)
    engine = LLMEngine(engine_config)
    if engine.parallel_group is not None:
        engine.parallel_group.on_failure = _exit_rank_failed
    kv = NixlTransferBackend(KVTransferConfig(agent_name=config.worker_id), rank_link(engine))
    runtime = WorkerRuntime(
        config,
        engine,
        kv,
        lambda info: Registrar(
            config.etcd,
            config.cluster,
            info,
            credentials=etcd_credentials,
            startup_check=check_peers,
        ),
        auth=auth,
        etcd_credentials=etcd_credentials,
        step_threads=step_threads,
    )
    if config.kv_transfer_selftest:
        transfer_selftest(runtime, nixl_peer)
    release_openmp_threads()  # built: only the engine thread runs parallel regions now
    runtime.freeze_heap = True
    return runtime


def transfer_selftest(rt: WorkerRuntime, make_peer: PeerFactory) -> SelftestResult:
    """Measure the worker's KV transfer path once (kvtransfer/selftest.py; `make_peer` makes a
    temporary agent of its backend's kind), before anything else uses the agent: log the
    result (a warning when slow, an error when it failed), set its /metrics gauges and what
    the registration publishes. Never raises: a worker whose self-test failed still starts."""
    from kvtransfer.selftest import LOW_RATIO, run_selftest

    result = run_selftest(rt.kv, rt.engine.kv_cache, make_peer)
    if not result.ok:
        log.error("%s; the worker starts anyway (docs/kvtransfer.md)", result.line())
    elif result.low:
        log.warning(
            "%s -- BELOW %.1fx MEMCPY: KV transfers will be slow; is UCX on TCP instead of "
            "shared memory (cma) or RDMA? Check UCX_NET_DEVICES and UCX_TLS, and "
            "UCX_PROTO_INFO=y for the transports UCX picks (docs/kvtransfer.md, "
            '"Self-test at start")',
            result.line(),
            LOW_RATIO,
        )
    else:
        log.info("%s", result.line())
    published = TransferSelftest.published(
        result.gbps, result.memcpy_gbps, result.ratio, result.path
    )
    rt.transfer_selftest = published
    rt.metrics.set_transfer_selftest(published)
    return result


async def serve(rt: WorkerRuntime, add_servicers: Callable[[grpc.aio.Server], None]) -> int:
    """Run until SIGTERM/SIGINT (exit code 0) or the engine loop's death (1).
    `add_servicers` puts the worker's services (the `Worker` service, service.py, and
    both roles') on its gRPC server."""
    import signal

    from cluster.net import free_port

    rt.attach(asyncio.get_running_loop())
    cfg = rt.config
    host = cfg.advertise_host or cfg.host
    server = make_grpc_server(rt.auth)
    add_servicers(server)
    port = add_port(server, f"{cfg.host}:{cfg.port}", rt.auth)
    if port == 0:
        raise RuntimeError(f"cannot listen on {cfg.host}:{cfg.port}")
    rt.grpc_address = f"{host}:{port}"
    if not rt.auth.authenticated:
        log.warning(
            "the gRPC port %s is unauthenticated: whoever reaches it can Generate, "
            "Prefill, Abort, Embed and read cached blocks (give --cluster-token-file "
            "or PDSERVE_CLUSTER_TOKEN, or --tls-cert/--tls-key/--tls-ca; "
            "docs/security.md)",
            rt.grpc_address,
        )
    else:
        log.info("gRPC callers must present: %s", rt.auth.describe())
    if not rt.worker_id:
        rt.worker_id = f"{cfg.role}-{host}-{port}"
    metrics_port = cfg.metrics_port or free_port(cfg.host)
    rt.metrics.serve(cfg.host, metrics_port)
    rt.metrics_address = f"{host}:{metrics_port}"

    rt.loop.start()
    # On the engine thread (its OpenMP pool, its allocator arena), before the worker
    # registers: its first request then pays no first-use set-up.
    await rt.call(lambda engine: engine.warm_up())
    if rt.freeze_heap:
        freeze_startup_heap()
    rt.transfer_progress.start()
    await server.start()
    refresher = asyncio.create_task(_refresh_stats(rt))
    try:
        await rt.registration.start()
    except Exception as exc:
        log.error("%s", exc)
        refresher.cancel()
        await server.stop(0)
        rt.loop.stop()
        rt.transfer_progress.stop()
        return 2 if isinstance(exc, RegistrationRefused) else 1
    log.info(
        "%s %s serving on %s (metrics %s)",
        cfg.role,
        rt.worker_id,
        rt.grpc_address,
        rt.metrics_address,
    )
    print(
        f"READY {cfg.role} {rt.worker_id} grpc={rt.grpc_address} metrics={rt.metrics_address}",
        flush=True,
    )

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    while not stop.is_set() and rt.loop.alive:
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    code = 0 if rt.loop.alive else 1
    if code:
        log.error("engine loop died; deregistering and exiting")
        rt.admission.move(WorkerPhase.SHUTTING_DOWN)
    else:
        await drain(rt)
    refresher.cancel()
    await rt.registration.deregister()
    await server.stop(1.0 if code == 0 else 0)
    rt.loop.stop()
    rt.transfer_progress.stop()
    if rt.step_threads is not None:
        rt.step_threads.close()
    rt.kv.close()
    rt.engine.close()  # the tensor-parallel ranks, if any
    return code


async def drain(rt: WorkerRuntime) -> None:
    """SHUTTING_DOWN (published at once), then wait for in-flight calls (bounded)."""
    rt.admission.move(WorkerPhase.SHUTTING_DOWN)
    await rt.republish()
    if not await rt.admission.wait_idle(rt.config.drain_timeout_s):
        log.warning("drain timeout: %d requests still in flight", rt.admission.inflight)


async def _refresh_stats(rt: WorkerRuntime) -> None:
    while rt.loop.alive:
        try:
            rt.stats = await rt.call(lambda e: e.stats())
            rt.metrics.update(rt.stats, rt.loop)
        except Exception:  # pragma: no cover - engine thread gone; the main loop exits
            log.exception("stats refresh failed")
        await asyncio.sleep(0.2)
