"""What a prefill and a decode worker share: the engine on its own thread, the KV transfer
agent, etcd registration, KV-event fan-out, /metrics, draining; the `Worker` gRPC service
in front of it is service.py (put on the server by the entry point, pdserve/worker_main.py,
with both roles' services).

Life cycle of a worker process: build (load model, size pool, register the pool with NIXL)
-> start (engine thread, gRPC server, metrics server, etcd registration; etcd unreachable at
start is fatal, and so, with exit code 2, is a registered worker of this KV layout that hashes
blocks differently: cluster/block_hash_agreement.py) -> serve -> SIGTERM: SHUTTING_DOWN
(published at once; new work is refused with UNAVAILABLE), wait for in-flight calls
(bounded), deregister, exit 0. If the engine loop dies (a step raised), every engine command
fails at once, the worker deregisters and the process exits 1, so its supervisor restarts it.
The worker's phase, the role it serves and the calls in flight: admission.py. Sleep / wake
up and weight updates (the router's fleet-wide admin calls): lifecycle.py. Both roles'
services are on every worker; switching the role served (`Worker.SetRole`, the engine
kept): roles.py.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import grpc

from cluster.etcd_security import EtcdCredentials
from cluster.grpc_auth import add_port, server_interceptors
from cluster.grpc_options import SERVER_OPTIONS
from cluster.grpc_security import ClusterAuth
from cluster.heap import freeze_startup_heap
from cluster.registration import Capacity, RegistrationRefused, WorkerInfo
from engine.block_hash import block_hash_probe
from engine.engine_loop import EngineLoop
from engine.llm_engine import EngineStats, LLMEngine
from engine.lora.request import LoRARequest
from engine.outputs import CompletionDelta
from kvtransfer import KVTransferBackend
from kvtransfer.poll_split import split_receiver, split_sender
from kvtransfer.progress import Collectable, TransferProgress
from proto import pdserve_pb2 as pb
from worker_runtime.adapters import ServedAdapters
from worker_runtime.admission import Admission, WorkerPhase
from worker_runtime.args import WorkerConfig
from worker_runtime.contexts import PULL_PREFIX, AbortHook, Listener, StepHook
from worker_runtime.grpc_errors import StatusInterceptor
from worker_runtime.host_cores import HostCoreShare, off_the_loop, release_openmp_threads, worker_threads
from worker_runtime.kv_events import KVEventFanout, kv_snapshot
from worker_runtime.kv_layout import kv_layout, rank_link
from worker_runtime.lifecycle import WorkerLifecycle
from worker_runtime.metrics import WorkerMetrics
from worker_runtime.paths import AllowedPaths
from worker_runtime.pool import PoolRegistration
from worker_runtime.pull_cost import PullCost
from worker_runtime.roles import WorkerRoles

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.pooling import PoolingParams
    from engine.request import Request
    from engine.sampling_params import SamplingParams
    from engine.tokens import Resume

log = logging.getLogger(__name__)
T = TypeVar("T")

def _exit_rank_failed(reason: str) -> None:
    """A tensor-parallel rank died: this worker cannot run its model; exit non-zero at once so
    that its supervisor (`pdserve up`) restarts it (its etcd lease lapses)."""
    log.error("%s: exiting", reason)
    logging.shutdown()
    os._exit(1)


class Registration(Protocol):
    """What the runtime needs of its etcd registration (cluster.registration.Registrar)."""

    async def start(self) -> None: ...

    async def publish_now(self) -> None: ...

    async def move(self, old_role: str) -> None: ...

    async def deregister(self) -> None: ...


RegistrationFor = Callable[[Callable[[], WorkerInfo]], Registration]
"""Makes the registration that publishes what the given callable describes."""


class _SplitView(Protocol):
    """What a `split_sender` / `split_receiver` view adds to KVSender / KVReceiver
    (kvtransfer/poll_split.py; those functions are typed with the base classes)."""

    @property
    def num_active(self) -> int: ...

    def collect(self) -> None: ...

    def on_work(self, callback: Callable[[], None] | None) -> None: ...

    def listen(self, listener: Listener | None) -> None: ...


def make_grpc_server(auth: ClusterAuth) -> grpc.aio.Server:
    """A worker's gRPC server: the cluster-token check first (when `auth` has a token: a call
    without it never reaches a servicer), then the exception -> status mapping."""
    return grpc.aio.server(interceptors=[*server_interceptors(auth), StatusInterceptor()],
                           options=[("grpc.so_reuseport", 0), *SERVER_OPTIONS])


class WorkerRuntime:
    def __init__(self, config: WorkerConfig, engine: LLMEngine, kv: KVTransferBackend,
                 registration_for: RegistrationFor, *, auth: ClusterAuth,
                 metrics: WorkerMetrics | None = None,
                 etcd_credentials: EtcdCredentials | None = None,
                 step_threads: HostCoreShare | None = None,
                 engine_loop: Callable[..., EngineLoop] = EngineLoop) -> None:
        """`engine` is built, not started (the runtime runs it on its loop thread); `kv` is
        the transfer agent the engine's pool is registered with here; `auth` (resolved from
        `config.grpc_security` at start) guards its gRPC port and the channels it opens to
        other workers; `etcd_credentials` (resolved from `config.etcd_security` at start)
        open every etcd client of this worker; `step_threads` sizes each step's threads from
        the host's idle cores (None: the thread count stays as set). `engine_loop` makes
        what runs the engine (called like EngineLoop): tests that step the engine by hand
        from their own thread pass a loop of theirs (tests/decode_node/decode_fakes.py)."""
        self.config = config
        self.auth = auth
        self.etcd_credentials = etcd_credentials
        self.engine = engine
        self.engine.block_manager.pool.record_events = True
        self.worker_id = config.worker_id
        self.kv = kv
        self.compat = kv_layout(engine)
        self.kv_cache_dtype = self.compat.kv_cache_dtype  # normalized: published, hashed by the router
        self.compat_hash = self.compat.hash()
        self.pool = PoolRegistration(kv, self.compat)
        self.pool.register(engine)
        # Peer pulls (kv_pull.py, kv_export.py) share the sender and receiver with the prompt
        # push: each side polls its own view, told apart by transfer id.
        self.sender, self.pull_sender = split_sender(kv.sender, PULL_PREFIX)
        self.receiver, self.pull_receiver = split_receiver(kv.receiver, PULL_PREFIX)
        self.transfer_progress = TransferProgress([cast(Collectable, self.sender),
                                                   cast(Collectable, self.receiver)])
        self.metrics = metrics or WorkerMetrics(config.role, kv, engine.loaded.model_id,
                                                engine.num_speculative_tokens)
        self.admission = Admission(config.role)
        self.paths = AllowedPaths(config.allowed_model_paths)
        self.registration = registration_for(self.info)
        self.lifecycle = WorkerLifecycle(
            self.admission, self.call, self.pool, self.republish, self.abort_all, self.paths,
            sleep_mode=engine.config.enable_sleep_mode, drain_timeout_s=config.drain_timeout_s)
        self.roles = WorkerRoles(
            self.admission, self.republish, self.registration.move, self.abort_all,
            self.metrics.set_role, drain_timeout_s=config.drain_timeout_s)
        self.streams: dict[str, asyncio.Queue[Any]] = {}
        """Calls that stream an engine request's deltas (Generate, Embed), by request id."""
        self.kv_events = KVEventFanout()
        """The KV-event streams (`SubscribeKVEvents`), fed after every engine step."""
        self._step_hooks: list[StepHook] = []
        self._abort_hooks: list[AbortHook] = []
        self.step_threads = step_threads
        self.loop = engine_loop(engine, self.deliver, self._after_step,
                               itl_target_s=config.itl_target_ms / 1000,
                               step_threads=step_threads)
        self.stats: EngineStats = engine.stats()
        self.adapters = ServedAdapters(engine, self.call, self.paths, self.republish)
        """LoRA adapters served here, by name (asyncio side; published in etcd)."""
        self.pull_cost = PullCost()
        """What this worker's peer pulls cost (kv_pull.py measures; published)."""
        self.grpc_address = ""
        self.metrics_address = ""
        self.aio: asyncio.AbstractEventLoop | None = None
        self.freeze_heap = False
        """Freeze the start-up heap once warmed up, before registering (cluster/heap.py): the
        production runtime (`build`) does; a runtime inside another process (tests) leaves
        that process's collector alone."""

    @classmethod
    def build(cls, config: WorkerConfig, engine_config: EngineConfig,
              auth: ClusterAuth, etcd_credentials: EtcdCredentials | None = None
              ) -> WorkerRuntime:
        """The production runtime: the engine, a NIXL agent, an etcd registration."""
        from cluster.block_hash_agreement import check_peers
        from cluster.registration import Registrar
        from kvtransfer import KVTransferConfig
        from kvtransfer.nixl_backend import NixlTransferBackend

        step_threads = worker_threads(config.num_threads, config.share_host_cores)
        engine = LLMEngine(engine_config)
        if engine.parallel_group is not None:
            engine.parallel_group.on_failure = _exit_rank_failed
        kv = NixlTransferBackend(KVTransferConfig(agent_name=config.worker_id), rank_link(engine))
        runtime = cls(config, engine, kv,
                      lambda info: Registrar(config.etcd, config.cluster, info,
                                             credentials=etcd_credentials,
                                             startup_check=check_peers),
                      auth=auth, etcd_credentials=etcd_credentials,
                      step_threads=step_threads)
        release_openmp_threads()  # built: only the engine thread runs parallel regions now
        runtime.freeze_heap = True
        return runtime

    def attach(self, aio: asyncio.AbstractEventLoop) -> None:
        """The asyncio loop this worker serves on: engine-thread results are handed there."""
        self.aio = aio

    def _aio(self) -> asyncio.AbstractEventLoop:
        if self.aio is None:
            raise RuntimeError("the worker runtime is not attached to an asyncio loop yet")
        return self.aio

    def create_future(self) -> asyncio.Future[Any]:
        """A future of the worker's asyncio loop (settled from the engine thread: `settle`)."""
        return self._aio().create_future()

    def create_task(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        return self._aio().create_task(coro)

    def call_later(self, delay_s: float, fn: Callable[..., object],
                   *args: object) -> asyncio.TimerHandle:
        return self._aio().call_later(delay_s, fn, *args)

    def listen_sender(self, listener: Listener | None) -> None:
        """Hear of each prompt-push result as soon as the transfer-progress thread
        collects it (the pull sender's results are not told)."""
        cast(_SplitView, self.sender).listen(listener)

    def own_metadata(self) -> bytes:
        """This worker's KV agent, as a peer writing into our blocks needs it."""
        metadata = self.pool.metadata
        if metadata is None:
            raise RuntimeError("the KV pool is not registered (the engine sleeps)")
        return metadata.to_bytes()

    # ---- engine thread side ------------------------------------------------------------
    def add_step_hook(self, hook: StepHook) -> None:
        """Run `hook(engine)` after every step, whatever role is served (True: work in flight)."""
        self._step_hooks.append(hook)

    def add_abort_hook(self, hook: AbortHook) -> None:
        """`Worker.Abort` tries the hooks in the order added until one returns True (handled)."""
        self._abort_hooks.append(hook)

    def deliver(self, deltas: list[CompletionDelta]) -> None:
        """Hand deltas (engine thread) to the asyncio queues of their requests."""
        for delta in deltas:
            queue = self.streams.get(delta.request_id)
            if queue is not None:
                self._aio().call_soon_threadsafe(queue.put_nowait, delta)

    def _after_step(self, engine: LLMEngine) -> bool:
        events = engine.block_manager.pool.take_events()
        if self.aio is not None:  # no subscriber before the worker serves
            self.kv_events.publish(self.aio, events)
        return any([hook(engine) for hook in self._step_hooks])  # every hook runs

    def settle(self, future: asyncio.Future[Any], result: Any = None,
               exc: BaseException | None = None) -> None:
        """From the engine thread: resolve an asyncio future on the worker's loop (once; a
        future already resolved or cancelled is left alone)."""
        self._aio().call_soon_threadsafe(_settle, future, result, exc)

    # ---- asyncio side -------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T], *, cancellable: bool = True) -> T:
        """Run fn(engine) on the engine thread; await its result (EngineLoopDied once the
        loop is dead).

        Cancelling the awaiting task before the engine thread took the command drops the
        command (the engine loop skips cancelled futures). Commands that record a fact the
        engine must not miss — a call ended, blocks to release — pass `cancellable=False`:
        they run whatever happens to the caller (who still sees CancelledError at once)."""
        future = asyncio.wrap_future(self.loop.call(fn))
        return await (future if cancellable else asyncio.shield(future))

    async def make_request(self, request_id: str, prompt_token_ids: list[int],
                           params: SamplingParams, cache_salt: str, priority: int,
                           lora: LoRARequest | None = None, resume: Resume | None = None,
                           pooling: PoolingParams | None = None) -> Request:
        """The engine request for a call (both roles; ValueError for invalid input). A
        structured request compiles its grammar, a LoRA request loads its adapter from disk:
        those are built off the event loop (`make_request` reads no mutable engine state, so
        it is safe off the engine thread). An adapter not served here already must lie under
        --allowed-model-paths."""
        if lora is not None and not self.adapters.serves_path(lora.lora_path):
            self.paths.check(lora.lora_path, "LoRA adapter")
        build = functools.partial(self.engine.make_request, request_id, prompt_token_ids, params,
                                  cache_salt or None, priority, resume=resume, pooling=pooling,
                                  lora_request=lora)
        if params.structured_outputs is None and lora is None:
            return build()
        return await off_the_loop(build)

    def open_stream(self, request_id: str) -> asyncio.Queue[Any]:
        """The queue the engine's deltas for `request_id` arrive on (until `close_stream`);
        ValueError if a call here already streams that request."""
        if request_id in self.streams:
            raise ValueError(f"request_id {request_id!r} is already live on this worker")
        queue = self.streams[request_id] = asyncio.Queue()
        return queue

    def close_stream(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    async def abort(self, request_id: str) -> bool:
        """Abort a request in any state; False if it was not (or no longer) known."""
        for hook in self._abort_hooks:
            if await hook(request_id):
                return True
        return bool(await self.call(lambda e: e.abort_request(request_id)))

    async def abort_all(self) -> None:
        """`Worker.Abort` every request this worker has: its streams and the engine's."""
        def live(e: LLMEngine) -> set[str]:
            s = e.scheduler
            return {r.group_id for r in (*s.running, *s.waiting, *s.waiting_for_kv.values())}

        ids = set(self.streams) | await self.call(live)
        await asyncio.gather(*(self.abort(rid) for rid in ids), return_exceptions=True)

    async def republish(self) -> None:
        await self.registration.publish_now()

    # ---- registration ------------------------------------------------------------------
    def info(self) -> WorkerInfo:
        metadata = self.pool.metadata
        return WorkerInfo(
            worker_id=self.worker_id, role=self.admission.role, grpc_address=self.grpc_address,
            model_id=self.engine.loaded.model_id, compat_hash=self.compat_hash,
            block_size=self.engine.config.block_size, max_model_len=self.engine.max_model_len,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_metadata=metadata.to_bytes().decode("ascii") if metadata is not None else "",
            sleeping=self.lifecycle.sleeping, weights_version=self.lifecycle.weights_version,
            metrics_address=self.metrics_address,
            draining=self.admission.phase.published_draining,
            loras=dict(self.adapters.by_name),
            resident_loras=tuple(sorted(r.lora_name for r in self.engine.list_loras())),
            capacity=self.capacity(),
            block_hash_probe=block_hash_probe(self.engine.config.block_size, self.kv_cache_dtype,
                                              self.lifecycle.weights_version),
        )

    def capacity(self) -> Capacity:
        """Load (the latest stats snapshot) and speed (the engine loop's step timings:
        measured, never assumed; 0 until measured)."""
        s, loop, cfg = self.stats, self.loop, self.engine.config
        prefill, decode = loop.prefill_steps, loop.decode_steps
        # In token blocks (what the router sizes a prompt in): a token block takes a block in
        # each KV group (engine/kv_groups.py) — at most; sliding groups give theirs back. The
        # second tier too: it holds one slot per (group, block).
        groups = self.engine.limits.kv_groups
        return Capacity(
            total_blocks=s.num_blocks // groups, free_blocks=s.num_free_blocks // groups,
            running=s.num_running + s.num_waiting_for_kv, waiting=s.num_waiting,
            queued_prefill_tokens=s.queued_prefill_tokens,
            prefill_tokens_per_s=prefill.prompt_tokens_per_s,
            decode_step_s=decode.seconds, decode_step_tokens=decode.tokens,
            prefill_step_s=prefill.seconds, prefill_step_tokens=prefill.tokens,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            long_prefill_token_threshold=min(
                [c for c in (self.engine.scheduler.long_prefill_token_threshold, loop.prompt_cap) if c],
                default=0),
            kv_offload_total_blocks=s.kv_offload_blocks // groups,
            kv_offload_used_blocks=s.kv_offload_blocks_used // groups,
            kv_promote_s_per_block=s.kv_offload_promote_s,
            kv_pull_blocks_per_s=self.pull_cost.blocks_per_s,
            kv_pull_overhead_s=self.pull_cost.overhead_s,
        )

    async def _refresh_stats(self) -> None:
        while self.loop.alive:
            try:
                self.stats = await self.call(lambda e: e.stats())
                self.metrics.update(self.stats, self.loop)
            except Exception:  # pragma: no cover - engine thread gone; the main loop exits
                log.exception("stats refresh failed")
            await asyncio.sleep(0.2)

    # ---- process life cycle --------------------------------------------------------------
    async def serve(self, add_servicers: Callable[[grpc.aio.Server], None]) -> int:
        """Run until SIGTERM/SIGINT (exit code 0) or the engine loop's death (1).
        `add_servicers` puts the worker's services (the `Worker` service, service.py, and
        both roles') on its gRPC server."""
        import signal

        from cluster.net import free_port

        self.attach(asyncio.get_running_loop())
        cfg = self.config
        host = cfg.advertise_host or cfg.host
        server = make_grpc_server(self.auth)
        add_servicers(server)
        port = add_port(server, f"{cfg.host}:{cfg.port}", self.auth)
        if port == 0:
            raise RuntimeError(f"cannot listen on {cfg.host}:{cfg.port}")
        self.grpc_address = f"{host}:{port}"
        if not self.auth.authenticated:
            log.warning("the gRPC port %s is unauthenticated: whoever reaches it can Generate, "
                        "Prefill, Abort, Embed and read cached blocks (give --cluster-token-file "
                        "or PDSERVE_CLUSTER_TOKEN, or --tls-cert/--tls-key/--tls-ca; "
                        "docs/security.md)", self.grpc_address)
        else:
            log.info("gRPC callers must present: %s", self.auth.describe())
        if not self.worker_id:
            self.worker_id = f"{cfg.role}-{host}-{port}"
        metrics_port = cfg.metrics_port or free_port(cfg.host)
        self.metrics.serve(cfg.host, metrics_port)
        self.metrics_address = f"{host}:{metrics_port}"

        self.loop.start()
        # On the engine thread (its OpenMP pool, its allocator arena), before the worker
        # registers: its first request then pays no first-use set-up.
        await self.call(lambda engine: engine.warm_up())
        if self.freeze_heap:
            freeze_startup_heap()
        self.transfer_progress.start()
        await server.start()
        refresher = asyncio.create_task(self._refresh_stats())
        try:
            await self.registration.start()
        except Exception as exc:
            log.error("%s", exc)
            refresher.cancel()
            await server.stop(0)
            self.loop.stop()
            self.transfer_progress.stop()
            return 2 if isinstance(exc, RegistrationRefused) else 1
        log.info("%s %s serving on %s (metrics %s)", cfg.role, self.worker_id,
                 self.grpc_address, self.metrics_address)
        print(f"READY {cfg.role} {self.worker_id} grpc={self.grpc_address} "
              f"metrics={self.metrics_address}", flush=True)

        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._aio().add_signal_handler(sig, stop.set)
        while not stop.is_set() and self.loop.alive:
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        code = 0 if self.loop.alive else 1
        if code:
            log.error("engine loop died; deregistering and exiting")
            self.admission.move(WorkerPhase.SHUTTING_DOWN)
        else:
            await self.drain()
        refresher.cancel()
        await self.registration.deregister()
        await server.stop(1.0 if code == 0 else 0)
        self.loop.stop()
        self.transfer_progress.stop()
        if self.step_threads is not None:
            self.step_threads.close()
        self.kv.close()
        self.engine.close()  # the tensor-parallel ranks, if any
        return code

    async def drain(self) -> None:
        """SHUTTING_DOWN (published at once), then wait for in-flight calls (bounded)."""
        self.admission.move(WorkerPhase.SHUTTING_DOWN)
        await self.republish()
        if not await self.admission.wait_idle(self.config.drain_timeout_s):
            log.warning("drain timeout: %d requests still in flight", self.admission.inflight)

    async def cached_blocks(self) -> pb.CachedBlocksResponse:
        """Every block hash held now, pool and second tier (`GetCachedBlocks`)."""
        return kv_snapshot(*await self.call(lambda e: e.block_manager.pool.held_hashes()))



def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)
