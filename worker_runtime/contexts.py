"""What each room of a worker gets from the runtime: a narrow, typed context, never the
runtime itself (STYLE 14). The runtime's side builds them (wiring.py, `room_contexts`); the
rooms — the prefill and decode servicers, the peer puller and exporter, the registered
peers — see only the callables and values named here.

Threads: `call`, `create_*` and abort hooks are the asyncio side's; `settle` and step hooks
run on the engine thread. Values that change while the worker runs (its id, set when it starts
serving; the pool's metadata, new after every wake-up; measured step rates) are callables, read when
used; the others are fixed for the worker's life.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:  # annotations only: the engine (torch) is the runtime's to import
    from cluster.etcd_security import EtcdCredentials
    from cluster.grpc_security import ClusterAuth
    from cluster.roles import Role
    from engine.core.limits import EngineLimits
    from engine.core.request import Request
    from engine.llm_engine import LLMEngine
    from engine.lora.request import LoRARequest
    from engine.processing.outputs import CompletionDelta
    from engine.processing.tokens import Resume, SampledToken
    from engine.sampling.pooling import PoolingParams
    from engine.sampling.sampling_params import SamplingParams
    from kvtransfer import KVReceiver, KVSender, TransferResult
    from worker_runtime.metrics import WorkerMetrics

T = TypeVar("T")

PULL_PREFIX = "pull:"
"""Transfer ids of peer pulls (kv_pull.py) start with this: the pull contexts' sender and
receiver see exactly those, the prefill and decode contexts' every other."""

StepHook = Callable[["LLMEngine"], bool]
"""Engine thread, after every step: True while the hook's owner has work in flight."""
AbortHook = Callable[[str], Awaitable[bool]]
"""`Worker.Abort`: True when the hook's owner handled the request id."""
Listener = Callable[["TransferResult"], None]
"""Hears of a transfer result as soon as the transfer-progress thread collects it."""


class EngineCall(Protocol):
    """`WorkerRuntime.call`: run fn(engine) on the engine thread and await its result.
    `cancellable=False`: the command runs even if the awaiting task is cancelled."""

    def __call__(
        self, fn: Callable[[LLMEngine], T], *, cancellable: bool = True
    ) -> Awaitable[T]: ...


class Settle(Protocol):
    """`WorkerRuntime.settle`: from the engine thread, resolve an asyncio future on the
    worker's loop (once; a future already done is left alone)."""

    def __call__(
        self, future: asyncio.Future[Any], result: Any = None, exc: BaseException | None = None
    ) -> None: ...


class MakeRequest(Protocol):
    """`WorkerRuntime.make_request`: the engine request for a call (ValueError for invalid
    input; grammars and LoRA adapters are loaded off the event loop)."""

    def __call__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str,
        priority: int,
        lora: LoRARequest | None = None,
        resume: Resume | None = None,
        pooling: PoolingParams | None = None,
    ) -> Awaitable[Request]: ...


@dataclass(frozen=True, slots=True)
class EngineSide:
    """What every room gets: the engine thread, the worker's asyncio loop, its metrics."""

    call: EngineCall
    settle: Settle
    add_step_hook: Callable[[StepHook], None]
    """Run the hook after every step, whatever role is served."""
    add_abort_hook: Callable[[AbortHook], None]
    """`Worker.Abort` tries the hooks in the order added until one handles the id."""
    create_future: Callable[[], asyncio.Future[Any]]
    create_task: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]
    kv_timeout_s: float
    """--kv-timeout: how long any KV transfer may take."""
    metrics: WorkerMetrics


@dataclass(frozen=True, slots=True)
class PeerContext:
    """`RegisteredPeers` (peers.py): where the cluster's registrations are, and the transfer
    agent's `add_peer`."""

    cluster: str
    etcd: str
    etcd_credentials: EtcdCredentials | None
    worker_id: Callable[[], str]
    add_peer: Callable[[bytes], str]
    """Load a peer's KV metadata (compatibility check, connect); blocking: off the loop."""


@dataclass(frozen=True, slots=True)
class PullContext(EngineSide):
    """`KVPuller` (kv_pull.py): the receiver's view of pull transfers and what sizes a pull."""

    receiver: KVReceiver
    """Sees only transfer ids starting with `PULL_PREFIX`."""
    auth: ClusterAuth
    worker_id: Callable[[], str]
    own_metadata: Callable[[], bytes]
    """This worker's KV agent, where a holder writes (the pool is registered)."""
    block_size: int
    prefill_tokens_per_s: Callable[[], float]
    """The measured prompt-token rate of this worker's prefill steps (0: not measured)."""
    observe_pull: Callable[[int, float], None]
    """Record a pull's blocks and seconds (published: `PullCost`)."""


@dataclass(frozen=True, slots=True)
class ExportContext(EngineSide):
    """`KVExporter` (kv_export.py): the sender's view of pull transfers."""

    sender: KVSender
    """Sees only transfer ids starting with `PULL_PREFIX`."""
    add_peer: Callable[[bytes], str]


@dataclass(frozen=True, slots=True)
class ServingContext(EngineSide):
    """What both role servicers use: admission, engine requests, their delta streams."""

    admitted: Callable[[Role, str], AbstractContextManager[None]]
    """Admit one call for a role (or refuse it) and count it in flight until it ends."""
    make_request: MakeRequest
    limits: EngineLimits
    open_stream: Callable[[str], asyncio.Queue[Any]]
    """The queue a request's deltas arrive on; ValueError if that id already streams."""
    close_stream: Callable[[str], None]


@dataclass(frozen=True, slots=True)
class PrefillContext(ServingContext):
    """`PrefillWorker` (prefill_node/worker.py): the prompt-push sender and its peers."""

    sender: KVSender
    """Sees every transfer id but pull ones."""
    listen_sender: Callable[[Listener | None], None]
    """Hear of each of `sender`'s results at once (transfer-progress thread)."""
    add_peer: Callable[[bytes], str]
    call_later: Callable[..., asyncio.TimerHandle]
    """The loop's `call_later(delay_s, fn, *args)`."""


@dataclass(frozen=True, slots=True)
class DecodeContext(ServingContext):
    """`DecodeWorker` and `PrefillClient` (decode_node/): the prompt-push receiver and what
    a remote prefill needs."""

    receiver: KVReceiver
    """Sees every transfer id but pull ones."""
    deliver: Callable[[list[CompletionDelta]], None]
    """Engine thread: hand deltas to their requests' streams."""
    auth: ClusterAuth
    own_metadata: Callable[[], bytes]
    strict_remote_prefill: bool
    """--strict-remote-prefill: a failed prefill worker fails the request."""
    vocab_size: int
    """The model's vocabulary: a first token a prefill worker returns must lie in it."""
    preview_first: Callable[[Request, SampledToken], CompletionDelta | None]
    """Any thread: the delta a parked request's first token will make when it is admitted
    (engine/processing/deltas.py `Deltas.preview_first`), so it can be sent at once."""
