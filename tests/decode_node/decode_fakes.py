"""A decode worker on a real WorkerRuntime over fakes, driven step by step from the test's
own thread.

The engine loop is `ManualEngineLoop`, which has no thread: `Harness.run_engine()` runs its
queued commands and the runtime's after-step work (every room's step hook) in the test
thread, so the test decides exactly where the asyncio side and the engine thread
interleave. The engine is a fake that counts block references; the KV receiver is the real
one over the fake transport; the prefill worker is a fake gRPC stub whose calls the test
resolves by hand. The worker is built as production builds it: its room contexts come from
`worker_runtime.wiring.room_contexts`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from unittest import mock

import grpc
import torch

from cluster.convert import sampling_from_pb
from cluster.grpc_security import OPEN
from engine.engine_loop import StepTimings
from engine.processing.outputs import CompletionDelta
from kvtransfer import FakeFabric, FakeTransferBackend, KVCompat, KVTransferConfig
from proto import pdserve_pb2 as pb
from worker_runtime.args import WorkerConfig
from worker_runtime.runtime import WorkerRuntime
from worker_runtime.wiring import room_contexts

BLOCK_SIZE = 4
VOCAB_SIZE = 100


class FakeBlockPool:
    """Reference counts of the blocks the worker holds beyond the engine's own request."""

    def __init__(self) -> None:
        self.refs: Counter[int] = Counter()

    def pin(self, block_ids):
        self.refs.update(block_ids)

    def release(self, block_ids):
        for b in block_ids:
            assert self.refs[b] > 0, f"block {b} released more often than pinned"
            self.refs[b] -= 1

    @property
    def held(self) -> list[int]:
        return sorted(b for b, n in self.refs.items() if n)

    def take_events(self) -> list:
        return []  # no KV events: nothing is cached here


@dataclass
class FakeEngine:
    block_manager: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(pool=FakeBlockPool())
    )
    allocated: dict[str, list[int]] = field(default_factory=dict)
    running: list[str] = field(default_factory=list)
    next_block: int = 0
    announce_first: bool = False
    first_finish: str | None = "length"  # the first delta's finish (None: the stream goes on)
    kv_cache: torch.Tensor = field(
        default_factory=lambda: torch.zeros(
            (64, 1, 1, 2, BLOCK_SIZE, 4)
        )  # [blocks, heads, layers, K/V, tokens, dim]
    )

    limits = SimpleNamespace(
        check_fits=lambda n: None, blocks_for=lambda n: -(-n // BLOCK_SIZE), kv_groups=1
    )
    loaded = SimpleNamespace(
        model_id="m",
        architecture="LlamaForCausalLM",
        args=SimpleNamespace(n_layers=1, window=lambda layer: None, vocab_size=VOCAB_SIZE),
    )
    config = SimpleNamespace(
        kv_cache_dtype="auto",
        enable_sleep_mode=False,
        lora_modules=(),
        block_size=BLOCK_SIZE,
        parallel=False,
    )

    def stats(self):
        return None

    def close(self):
        pass

    def make_request(
        self,
        rid,
        prompt,
        params,
        cache_salt=None,
        priority=0,
        resume=None,
        pooling=None,
        lora_request=None,
    ):
        outputs = len(resume.output_token_ids) if resume is not None else 0
        return SimpleNamespace(
            request_id=rid,
            prompt_token_ids=list(prompt),
            num_prompt_tokens=len(prompt),
            num_tokens=len(prompt) + outputs,
            sampling=params,
            cache_salt=cache_salt,
            priority=priority,
            seed=7,
            num_cached_tokens=0,
            lora=None,
            remote_prefill_ok=params.remote_prefill_ok and resume is None,
        )

    def add_remote_prefill_request(self, req):
        n = self.limits.blocks_for(req.num_prompt_tokens)
        blocks = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        self.allocated[req.request_id] = blocks
        req.remote_skip_blocks = [0]  # one KV group, no local hit
        return blocks

    def finish_remote_prefill(self, rid, token):
        self.running.append(rid)  # and finished at once: one token, max_tokens reached
        return [self._first_delta(rid, token)]

    def preview_remote_first(self, req, token):
        """The first delta before admission when `announce_first` (as the real engine);
        None otherwise (as for a request with a grammar)."""
        return self._first_delta(req.request_id, token) if self.announce_first else None

    def _first_delta(self, rid, token):
        n = len(self.allocated[rid]) * BLOCK_SIZE
        return CompletionDelta(
            request_id=rid,
            index=0,
            token_ids=[token.token_id],
            text="",
            logprobs=[],
            finish_reason=self.first_finish,
            num_prompt_tokens=n,
            num_cached_tokens=n,
            num_output_tokens=1,
        )

    def submit(self, req):
        self.running.append(req.request_id)

    def abort_request(self, rid):
        found = self.allocated.pop(rid, None) is not None
        if rid in self.running:
            self.running.remove(rid)
            found = True
        return found


class ManualEngineLoop:
    """An engine loop without a thread (what `WorkerRuntime` takes as `engine_loop`): commands
    queue until the test calls `run_round`, which runs them and then the after-step work in
    the caller's thread."""

    def __init__(self, engine, on_deltas, after_step, **_: object) -> None:
        self.engine = engine
        self._after_step = after_step
        self._commands: list[tuple] = []
        self.alive = True
        self.prompt_cap = 0
        self.prefill_steps = StepTimings()
        self.decode_steps = StepTimings()

    def call(self, fn) -> Future:
        future: Future = Future()
        self._commands.append((fn, future))
        return future

    def wake(self) -> None:
        """Nothing to wake: the test runs each round by hand."""

    def run_round(self) -> None:
        """The queued commands (a cancelled one is skipped), then the after-step work."""
        while self._commands:
            fn, future = self._commands.pop(0)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:  # handed to the caller, as the real loop does
                future.set_exception(exc)
        self._after_step(self.engine)

    def start(self) -> None: ...

    def stop(self, timeout: float = 5.0) -> None: ...


class FakeRegistration:
    """An etcd registration that publishes nowhere."""

    async def start(self) -> None: ...

    async def publish_now(self) -> None: ...

    async def move(self, old_role: str) -> None: ...

    async def deregister(self) -> None: ...


class FakeCall:
    """A `Prefill` call the test ends by hand."""

    def __init__(self, request: pb.PrefillRequest) -> None:
        self.request = request
        self.future = asyncio.get_running_loop().create_future()
        self.cancelled = False

    def __await__(self):
        return self.future.__await__()

    def cancel(self):
        self.cancelled = True
        if not self.future.done():
            self.future.cancel()


class Harness:
    """A DecodeWorker on a fake runtime (see the module docstring)."""

    def __init__(
        self, kv_timeout_s: float = 30.0, allowed_model_paths: tuple[str, ...] = ()
    ) -> None:
        from decode_node.worker import DecodeWorker
        from worker_runtime.kv_pull import KVPuller

        self.engine = FakeEngine()
        fabric = FakeFabric()
        config = WorkerConfig(
            role="decode",
            etcd="unused:0",
            kv_timeout_s=kv_timeout_s,
            allowed_model_paths=allowed_model_paths,
        )
        rt = WorkerRuntime(
            config,
            self.engine,
            FakeTransferBackend(fabric, KVTransferConfig(agent_name="D")),
            lambda info: FakeRegistration(),
            auth=OPEN,
            metrics=mock.MagicMock(),
            engine_loop=ManualEngineLoop,
        )
        rt.attach(asyncio.get_running_loop())
        self.p_kv = _backend(fabric, "P")  # the prefill worker's side, to land KV by hand
        self.p_kv.add_peer(rt.kv.metadata())
        self.rt = rt
        self.calls: list[FakeCall] = []
        self.destinations: list[str] = []  # transfer ids SetDestination was called for
        self.aborts: list[str] = []
        self.abort_reply: asyncio.Future | None = None  # None: P answers Abort at once
        self.abort_error: Exception | None = None  # P's Abort fails with this
        stubs = {"PrefillWorkerStub": self._prefill_stub, "WorkerStub": self._worker_stub}
        # The generated module itself: prefill_client calls Prefill through it, and
        # worker_runtime.peer_calls.confirm_stopped calls Abort.
        self._patch = mock.patch.multiple("proto.pdserve_pb2_grpc", **stubs)
        self._patch.start()
        rooms = room_contexts(rt)
        self.worker = DecodeWorker(rooms.decode, KVPuller(rooms.pull))

    def close(self) -> None:
        self._patch.stop()

    def _prefill_stub(self, channel):
        def prefill(request, timeout=None):
            self.calls.append(FakeCall(request))
            return self.calls[-1]

        async def set_destination(dest, timeout=None):
            """The deferred destination lands in its call's request, as P would apply it."""
            [call] = [
                c for c in self.calls if c.request.destination.transfer_id == dest.transfer_id
            ]
            assert call.request.destination.deferred and not call.request.destination.block_ids
            call.request.destination.block_ids[:] = dest.block_ids
            call.request.destination.num_skip_blocks = dest.num_skip_blocks
            call.request.destination.group_skip_blocks[:] = dest.group_skip_blocks
            self.destinations.append(dest.transfer_id)
            return pb.SetDestinationResponse()

        return SimpleNamespace(Prefill=prefill, SetDestination=set_destination)

    def _worker_stub(self, channel):
        async def abort(request, timeout=None):
            self.aborts.append(request.request_id)
            if self.abort_error is not None:
                raise self.abort_error
            if self.abort_reply is not None:
                await self.abort_reply
            return pb.AbortResponse(found=True)

        return SimpleNamespace(Abort=abort)

    def run_engine(self) -> None:
        """One round of the engine thread: queued commands, then the after-step hook."""
        self.rt.loop.run_round()

    async def spin(self, rounds: int = 20, engine: bool = True) -> None:
        """Let asyncio tasks run (and the engine thread, unless `engine` is False)."""
        for _ in range(rounds):
            await asyncio.sleep(0)
            if engine:
                self.run_engine()

    async def spin_until(self, done, timeout_s: float = 10.0) -> None:
        """`spin` until `done()`: for work the worker hands to a thread (a LoRA request's
        build), which takes more than a few event-loop rounds."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not done():
            assert asyncio.get_running_loop().time() < deadline, "timed out"
            await asyncio.sleep(0.005)
            self.run_engine()

    def generate(
        self,
        rid: str,
        num_tokens: int = 10,
        lora: pb.LoRAAdapter | None = None,
        into: list | None = None,
    ) -> asyncio.Task:
        """Generate `rid`; the task's result is every response, which also land in `into`
        (when given) as they arrive."""
        request = pb.GenerateRequest(
            request_id=rid,
            prompt_token_ids=list(range(1, num_tokens + 1)),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=3),
            prefill_worker=pb.WorkerRef(worker_id="P", address="p:1"),
            lora=lora,
        )
        assert sampling_from_pb(request.sampling).remote_prefill_ok

        async def consume():
            out = into if into is not None else []
            async for response in self.worker.Generate(request, _Context()):
                out.append(response)
            return out

        return asyncio.ensure_future(consume())

    async def started(
        self, rid: str = "r", kv_landed: bool = False
    ) -> tuple[asyncio.Task, FakeCall]:
        """`generate(rid)`, spun until its Prefill call to P is out (and, with `kv_landed`,
        until P's KV for it has landed here): (the Generate task, P's call)."""
        task = self.generate(rid)
        await self.spin()
        call = self.calls[0]
        if kv_landed:
            await self.land_kv(call)
            await self.spin()
        return task, call

    async def fell_back(self, rid: str = "r", aborts: int = 1) -> None:
        """Steps the engine (5 s at most) until P's attempt at `rid` is given up and `rid`
        prefills here: P was sent `aborts` Aborts, no block stays held, `rid` runs here."""
        await self.spin_until(
            lambda: not self.held and len(self.aborts) >= aborts and bool(self.engine.running),
            timeout_s=5,
        )
        assert self.aborts == [rid] * aborts  # P's attempt was dropped, its blocks released
        assert self.engine.running == [rid]  # prefilled here instead

    async def land_kv(self, call: FakeCall) -> None:
        """P writes every block the call asked for (final batch included)."""
        dest = call.request.destination
        self.p_kv.sender.send(
            dest.transfer_id, "D", [(i, b) for i, b in enumerate(dest.block_ids)], final=True
        )
        self.p_kv.sender.poll()  # the fake copies here, then notifies D

    @property
    def held(self) -> list[int]:
        """Blocks pinned beyond their request (quarantined)."""
        return self.engine.block_manager.pool.held

    @staticmethod
    def response() -> pb.PrefillResponse:
        return pb.PrefillResponse(first_token=pb.TokenLogprob(token_id=42), num_cached_tokens=0)


def unavailable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="connection refused",
    )


def unauthenticated() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="wrong cluster token: ...",
    )


def _backend(fabric: FakeFabric, name: str) -> FakeTransferBackend:
    backend = FakeTransferBackend(fabric, KVTransferConfig(agent_name=name))
    pool = torch.zeros((64, 1, 1, 2, BLOCK_SIZE, 4))  # [blocks, heads, layers, K/V, tokens, dim]
    backend.register_pool(
        pool, KVCompat.for_pool(pool, "m", architecture="LlamaForCausalLM", layer_windows="full")
    )
    return backend


class _Context:
    async def abort(self, code, details):
        raise grpc.RpcError(f"{code}: {details}")
