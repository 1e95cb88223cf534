"""What a prefill and a decode worker share: the engine on its own thread, the KV transfer
agent, etcd registration, KV-event fan-out, /metrics, draining; the `Worker` gRPC service
in front of it is service.py (put on the server by the entry point, pdserve/worker_main.py,
with both roles' services). Its process life cycle (build, start, serve, drain, exit):
process.py. The rooms (both roles' servicers, the peer pull and export) see it only through
their contexts (contexts.py, built by wiring.py).

The worker's phase, the role it serves and the calls in flight: admission.py. Sleep / wake
up and weight updates (the router's fleet-wide admin calls): lifecycle.py. Both roles'
services are on every worker; switching the role served (`Worker.SetRole`, the engine
kept): roles.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import grpc

from cluster.etcd_security import EtcdCredentials
from cluster.grpc_auth import server_interceptors
from cluster.grpc_options import SERVER_OPTIONS
from cluster.grpc_security import ClusterAuth
from cluster.registration import Capacity, TransferSelftest, WorkerInfo
from engine.engine_loop import EngineLoop
from engine.kv.block_hash import block_hash_probe
from engine.llm_engine import EngineStats, LLMEngine
from engine.lora.request import LoRARequest
from engine.processing.outputs import CompletionDelta
from kvtransfer import KVTransferBackend
from kvtransfer.poll_split import split_receiver, split_sender
from kvtransfer.progress import Collectable, TransferProgress
from proto import pdserve_pb2 as pb
from worker_runtime.adapters import ServedAdapters
from worker_runtime.admission import Admission
from worker_runtime.args import WorkerConfig
from worker_runtime.capacity import capacity_of
from worker_runtime.contexts import PULL_PREFIX, AbortHook, Listener, StepHook
from worker_runtime.grpc_errors import StatusInterceptor
from worker_runtime.host_cores import HostCoreShare, off_the_loop
from worker_runtime.kv_events import KVEventFanout, kv_snapshot
from worker_runtime.kv_layout import kv_layout
from worker_runtime.lifecycle import WorkerLifecycle
from worker_runtime.metrics import WorkerMetrics
from worker_runtime.paths import AllowedPaths
from worker_runtime.pool import PoolRegistration
from worker_runtime.pull_cost import PullCost
from worker_runtime.roles import WorkerRoles

if TYPE_CHECKING:
    from engine.core.request import Request
    from engine.processing.tokens import Resume
    from engine.sampling.pooling import PoolingParams
    from engine.sampling.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")
IN_FLIGHT_WAIT_S = 0.05
"""The engine loop's look at transfers in flight while idle: a safety net only, since the
transfer-progress thread wakes it on every result (a decode worker used to wake every
millisecond while a long prompt's KV was on its way)."""


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
    return grpc.aio.server(
        interceptors=[*server_interceptors(auth), StatusInterceptor()],
        options=[("grpc.so_reuseport", 0), *SERVER_OPTIONS],
    )


class WorkerRuntime:
    def __init__(
        self,
        config: WorkerConfig,
        engine: LLMEngine,
        kv: KVTransferBackend,
        registration_for: RegistrationFor,
        *,
        auth: ClusterAuth,
        metrics: WorkerMetrics | None = None,
        etcd_credentials: EtcdCredentials | None = None,
        step_threads: HostCoreShare | None = None,
        engine_loop: Callable[..., EngineLoop] = EngineLoop,
    ) -> None:
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
        self.kv_cache_dtype = (
            self.compat.kv_cache_dtype
        )  # normalized: published, hashed by the router
        self.compat_hash = self.compat.hash()
        self.pool = PoolRegistration(kv, self.compat)
        self.pool.register(engine)
        # Peer pulls (kv_pull.py, kv_export.py) share the sender and receiver with the prompt
        # push: each side polls its own view, told apart by transfer id.
        self.sender, self.pull_sender = split_sender(kv.sender, PULL_PREFIX)
        self.receiver, self.pull_receiver = split_receiver(kv.receiver, PULL_PREFIX)
        # Every transfer result wakes the engine loop (event-driven: no millisecond polls).
        self.transfer_progress = TransferProgress(
            [cast(Collectable, self.sender), cast(Collectable, self.receiver)],
            on_results=lambda: self.loop.wake(),
        )
        self.metrics = metrics or WorkerMetrics(
            config.role, kv, engine.loaded.model_id, engine.num_speculative_tokens
        )
        self.admission = Admission(config.role)
        self.paths = AllowedPaths(config.allowed_model_paths)
        self.registration = registration_for(self.info)
        self.lifecycle = WorkerLifecycle(
            self.admission,
            self.call,
            self.pool,
            self.republish,
            self.abort_all,
            self.paths,
            sleep_mode=engine.config.enable_sleep_mode,
            drain_timeout_s=config.drain_timeout_s,
        )
        self.roles = WorkerRoles(
            self.admission,
            self.republish,
            self.registration.move,
            self.abort_all,
            self.metrics.set_role,
            drain_timeout_s=config.drain_timeout_s,
        )
        self.streams: dict[str, asyncio.Queue[Any]] = {}
        """Calls that stream an engine request's deltas (Generate, Embed), by request id."""
        self.kv_events = KVEventFanout()
        """The KV-event streams (`SubscribeKVEvents`), fed after every engine step."""
        self._step_hooks: list[StepHook] = []
        self._abort_hooks: list[AbortHook] = []
        self.step_threads = step_threads
        self.loop = engine_loop(
            engine,
            self.deliver,
            self._after_step,
            itl_target_s=config.itl_target_ms / 1000,
            step_threads=step_threads,
            in_flight_wait_s=IN_FLIGHT_WAIT_S,
        )
        self.stats: EngineStats = engine.stats()
        self.adapters = ServedAdapters(engine, self.call, self.paths, self.republish)
        """LoRA adapters served here, by name (asyncio side; published in etcd)."""
        self.pull_cost = PullCost()
        """What this worker's peer pulls cost (kv_pull.py measures; published)."""
        self.transfer_selftest: TransferSelftest | None = None
        """The KV transfer self-test at start (process.py runs it; published); None: not run."""
        self.grpc_address = ""
        self.metrics_address = ""
        self.aio: asyncio.AbstractEventLoop | None = None
        self.freeze_heap = False
        """Freeze the start-up heap once warmed up, before registering (cluster/heap.py): the
        production runtime (`build`) does; a runtime inside another process (tests) leaves
        that process's collector alone."""

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

    def call_later(
        self, delay_s: float, fn: Callable[..., object], *args: object
    ) -> asyncio.TimerHandle:
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

    def settle(
        self, future: asyncio.Future[Any], result: Any = None, exc: BaseException | None = None
    ) -> None:
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

    async def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str,
        priority: int,
        lora: LoRARequest | None = None,
        resume: Resume | None = None,
        pooling: PoolingParams | None = None,
    ) -> Request:
        """The engine request for a call (both roles; ValueError for invalid input). A
        structured request compiles its grammar, a LoRA request loads its adapter from disk:
        those are built off the event loop (`make_request` reads no mutable engine state, so
        it is safe off the engine thread). An adapter not served here already must lie under
        --allowed-model-paths."""
        if lora is not None and not self.adapters.serves_path(lora.lora_path):
            self.paths.check(lora.lora_path, "LoRA adapter")
        build = functools.partial(
            self.engine.make_request,
            request_id,
            prompt_token_ids,
            params,
            cache_salt or None,
            priority,
            resume=resume,
            pooling=pooling,
            lora_request=lora,
        )
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
            worker_id=self.worker_id,
            role=self.admission.role,
            grpc_address=self.grpc_address,
            model_id=self.engine.loaded.model_id,
            compat_hash=self.compat_hash,
            block_size=self.engine.config.block_size,
            max_model_len=self.engine.max_model_len,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_metadata=metadata.to_bytes().decode("ascii") if metadata is not None else "",
            sleeping=self.lifecycle.sleeping,
            weights_version=self.lifecycle.weights_version,
            metrics_address=self.metrics_address,
            draining=self.admission.phase.published_draining,
            loras=dict(self.adapters.by_name),
            resident_loras=tuple(sorted(r.lora_name for r in self.engine.list_loras())),
            capacity=self.capacity(),
            block_hash_probe=block_hash_probe(
                self.engine.config.block_size, self.kv_cache_dtype, self.lifecycle.weights_version
            ),
            transfer_selftest=self.transfer_selftest,
        )

    def capacity(self) -> Capacity:
        return capacity_of(self.engine, self.stats, self.loop, self.pull_cost)

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
