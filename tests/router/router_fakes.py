"""FakeWorker: an in-process prefill or decode worker for router tests — a grpc.aio server
implementing `Worker` (+ `DecodeWorker` for decode) with deterministic fake tokens, a prefix
cache of real block hashes (engine.kv.block_hash) that feeds KV events, and a registration in a
real etcd through cluster.registration.Registrar.

Tokens: completion i of a prompt p emits ids 100 + (sum(p) + 7k + 13i) % 1000 for k = 0, 1, ...
each with text " w<id>", or `behavior.script`'s (id, text) pairs. Logprobs: the sampled token
-0.5 (rank 2), top k = id + 1, id + 2, ... at -0.25, -0.75, ... (the sampled token is never
among them); prompt logprobs likewise for each prompt token after the first. A stop string
ends a completion with stop_str set. A resumed request (resume_output_token_ids, a
migration) continues at k = len(resume_output_token_ids). Failure injection, stalls and
per-token delays are set on `behavior`; every GenerateRequest received is kept in
`requests`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

import grpc

from cluster.grpc_options import SERVER_OPTIONS
from cluster.registration import Capacity, Registrar, WorkerInfo
from cluster.roles import PrefillPath
from engine.kv.block_hash import compute_block_hashes
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

MODEL_ID = "SmolLM2-135M-Instruct"
_LIVE: dict[str, "FakeWorker"] = {}  # worker id -> fake (remote prefill goes through here)


def fake_token(prompt: list[int], index: int, k: int) -> int:
    return 100 + (sum(prompt) + 7 * k + 13 * index) % 1000


@dataclass
class Behavior:
    fail_before_first_token: int = 0
    """The next this-many Generate calls fail with UNAVAILABLE before any token."""
    fail_after_tokens: int | None = None
    """Generate calls fail with INTERNAL after this many tokens."""
    stall_after_tokens: int | None = None
    """Generate calls stop streaming (but stay open) after this many tokens."""
    fail_before_finish: bool = False
    """A completion's last token goes out without its finish_reason, then the call fails
    (a worker that dies between its last token and its end)."""
    token_delay_s: float = 0.0
    default_max_tokens: int = 32
    script: list[tuple[int, str]] | None = None
    """Tokens (id, text delta) every completion emits instead of the fake ones."""
    script_finish: str = "length"
    """The finish reason of the script's last token ("stop": as if it were the model's EOS)."""


@dataclass
class FakeWorker:
    role: str
    etcd: str
    cluster: str
    worker_id: str
    block_size: int = 16
    capacity: Capacity = field(
        default_factory=lambda: Capacity(total_blocks=1000, free_blocks=1000)
    )
    model_id: str = MODEL_ID
    compat_hash: str = "fake-compat"
    draining: bool = False
    behavior: Behavior = field(default_factory=Behavior)
    max_model_len: int = 0
    loras: dict = field(default_factory=dict)  # served LoRA adapters, name -> path
    resident_loras: tuple = ()
    lora_calls: list = field(default_factory=list)  # ("load" | "unload", name)

    def __post_init__(self) -> None:
        self.cached: list[bytes] = []  # prefix cache, insertion order
        self.tiered: set[bytes] = set()  # those of them in the second KV tier
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.active: set[str] = set()
        self._subscribers: set[asyncio.Queue] = set()
        self._server: grpc.aio.Server | None = None
        self.registrar: Registrar | None = None
        self.address = ""

    # ---- life cycle -----------------------------------------------------------------------
    async def start(
        self, publish_interval_s: float = 0.1, register: bool = True, port: int = 0
    ) -> "FakeWorker":
        self._server = grpc.aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_WorkerServicer_to_server(_WorkerService(self), self._server)
        if self.role == "decode":
            pb_grpc.add_DecodeWorkerServicer_to_server(_DecodeService(self), self._server)
        port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        self.address = f"127.0.0.1:{port}"
        await self._server.start()
        _LIVE[self.worker_id] = self
        if not register:
            return self
        self.registrar = Registrar(
            self.etcd, self.cluster, self.info, ttl_s=2, publish_interval_s=publish_interval_s
        )
        await self.registrar.start()
        return self

    async def stop(self, deregister: bool = True) -> None:
        """deregister=False: vanish without a word (the lease lapses later)."""
        if self.registrar is not None:
            if deregister:
                await self.registrar.deregister()
            else:
                self.registrar._task.cancel()  # stop refreshing; keep the lease to expire
                self.registrar._task = None
        if self._server is not None:
            await self._server.stop(None)
        _LIVE.pop(self.worker_id, None)

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            self.worker_id,
            self.role,
            self.address,
            self.model_id,
            self.compat_hash,
            self.block_size,
            draining=self.draining,
            capacity=self.capacity,
            max_model_len=self.max_model_len,
            loras=dict(self.loras),
            resident_loras=tuple(self.resident_loras),
        )

    def set_capacity(self, **changes) -> None:
        self.capacity = replace(self.capacity, **changes)

    # ---- prefix cache -----------------------------------------------------------------------
    def store(self, hashes: list[bytes]) -> None:
        new = [h for h in hashes if h not in self.cached]
        self.cached.extend(new)
        self._publish(pb.KVEventBatch(stored=new))

    def demote(self, hashes: list[bytes]) -> None:
        """Cached blocks move to the second tier: stored again, with tier 1."""
        moved = [h for h in hashes if h in self.cached and h not in self.tiered]
        self.tiered.update(moved)
        self._publish(pb.KVEventBatch(stored=moved, stored_tiers=[1] * len(moved)))

    def evict(self, hashes: list[bytes]) -> None:
        gone = [h for h in hashes if h in self.cached]
        self.cached = [h for h in self.cached if h not in gone]
        self.tiered.difference_update(gone)
        self._publish(pb.KVEventBatch(removed=gone))

    def cached_prefix_tokens(self, hashes: list[bytes], num_prompt: int) -> int:
        n = 0
        for h in hashes[: (num_prompt - 1) // self.block_size]:
            if h not in self.cached:
                break
            n += 1
        return n * self.block_size

    def _publish(self, batch: pb.KVEventBatch) -> None:
        if batch.stored or batch.removed:
            for q in self._subscribers:
                q.put_nowait(batch)


class _WorkerService(pb_grpc.WorkerServicer):
    def __init__(self, w: FakeWorker) -> None:
        self.w = w

    async def Health(self, request, context):
        c = self.w.capacity
        return pb.HealthResponse(
            role=self.w.role,
            worker_id=self.w.worker_id,
            model_id=self.w.model_id,
            draining=self.w.draining,
            capacity=pb.Capacity(total_blocks=c.total_blocks, free_blocks=c.free_blocks),
        )

    async def Abort(self, request, context):
        return pb.AbortResponse(found=request.request_id in self.w.active)

    async def SubscribeKVEvents(self, request, context):
        await context.send_initial_metadata(())
        queue: asyncio.Queue = asyncio.Queue()
        self.w._subscribers.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self.w._subscribers.discard(queue)

    async def GetCachedBlocks(self, request, context):
        cached, tiered = self.w.cached, self.w.tiered
        return pb.CachedBlocksResponse(
            block_hashes=list(cached), tiers=[int(h in tiered) for h in cached] if tiered else []
        )

    async def LoadLoRAAdapter(self, request, context):
        """Prefill workers refuse paths containing "bad" (INVALID_ARGUMENT), as a real worker
        an invalid adapter."""
        a = request.adapter
        self.w.lora_calls.append(("load", a.name))
        if "bad" in a.path and self.w.role == "prefill":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"adapter {a.name!r}: bad rank")
        self.w.loras[a.name] = a.path
        await self.w.registrar.publish_now()
        return pb.LoRAResponse(found=True)

    async def UnloadLoRAAdapter(self, request, context):
        self.w.lora_calls.append(("unload", request.name))
        found = self.w.loras.pop(request.name, None) is not None
        await self.w.registrar.publish_now()
        return pb.LoRAResponse(found=found)


class _DecodeService(pb_grpc.DecodeWorkerServicer):
    def __init__(self, w: FakeWorker) -> None:
        self.w = w

    async def Generate(self, request: pb.GenerateRequest, context):
        w, b = self.w, self.w.behavior
        w.requests.append(request)
        if b.fail_before_first_token > 0:
            b.fail_before_first_token -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected failure before first token")
        prompt = list(request.prompt_token_ids)
        hashes = compute_block_hashes(prompt, w.block_size, request.cache_salt or None)
        cached = w.cached_prefix_tokens(hashes, len(prompt))
        mode = PrefillPath.LOCAL
        if request.HasField("prefill_worker"):
            p = _LIVE.get(request.prefill_worker.worker_id)
            if p is not None:
                mode = PrefillPath.REMOTE
                cached = max(cached, p.cached_prefix_tokens(hashes, len(prompt)))
                p.store(hashes)
        w.store(hashes)
        s = request.sampling
        max_tokens = s.max_tokens if s.HasField("max_tokens") else b.default_max_tokens
        if b.script is not None:
            max_tokens = min(max_tokens, len(b.script))
        prompt_lps = (
            [_logprob(t, s.prompt_logprobs) for t in prompt[1:]]
            if s.HasField("prompt_logprobs")
            else []
        )
        w.active.add(request.request_id)
        sent = 0
        start = len(request.resume_output_token_ids)
        try:
            if start and start >= max_tokens:  # every output came before, only the end was lost
                yield pb.GenerateResponse(
                    finish_reason="length",
                    usage=pb.Usage(
                        prompt_tokens=len(prompt), completion_tokens=start, cached_tokens=cached
                    ),
                    prefill_mode=mode,
                )
                return
            texts = ["" for _ in range(s.n or 1)]
            if start:  # a migrated request: its text so far, for stop strings
                texts[0] = "".join(
                    b.script[k][1] if b.script is not None else f" w{fake_token(prompt, 0, k)}"
                    for k in range(start)
                )
            for k in range(start, max_tokens):
                for i in range(s.n or 1):
                    if texts[i] is None:
                        continue
                    if b.fail_after_tokens is not None and sent >= b.fail_after_tokens:
                        await context.abort(grpc.StatusCode.INTERNAL, "injected failure mid-stream")
                    if b.stall_after_tokens is not None and sent >= b.stall_after_tokens:
                        await asyncio.Event().wait()
                    if b.token_delay_s:
                        await asyncio.sleep(b.token_delay_s)
                    tok, text = (
                        b.script[k]
                        if b.script is not None
                        else (fake_token(prompt, i, k), f" w{fake_token(prompt, i, k)}")
                    )
                    finish = "length" if k == max_tokens - 1 else ""
                    if finish and b.script is not None and k == len(b.script) - 1:
                        finish = b.script_finish
                    stop = _first_stop(texts[i] + text, list(s.stop))
                    if stop is not None:
                        cut, stop_str = stop
                        end = cut + (len(stop_str) if s.include_stop_str_in_output else 0)
                        text, finish = (texts[i] + text)[:end][len(texts[i]) :], "stop"
                    texts[i] = None if finish else texts[i] + text
                    sent += 1
                    msg = pb.GenerateResponse(
                        index=i,
                        token_ids=[tok],
                        text=text,
                        finish_reason=finish,
                        logprobs=[_logprob(tok, s.logprobs)] if s.HasField("logprobs") else [],
                        usage=pb.Usage(
                            prompt_tokens=len(prompt), completion_tokens=k + 1, cached_tokens=cached
                        ),
                        prefill_mode=mode,
                        prompt_logprobs=prompt_lps,
                    )
                    prompt_lps = []  # first response only
                    if stop is not None:
                        msg.stop_str = stop[1]
                    if finish and b.fail_before_finish:
                        msg.finish_reason = ""
                        yield msg
                        await context.abort(grpc.StatusCode.INTERNAL, "injected failure at the end")
                    yield msg
                if all(t is None for t in texts):
                    break
        except asyncio.CancelledError:
            w.cancelled.append(request.request_id)
            raise
        finally:
            w.active.discard(request.request_id)


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits) if hits else None


def _logprob(tok: int, k: int) -> pb.TokenLogprob:
    top = [pb.TopLogprob(token_id=tok + 1 + j, logprob=-0.25 - 0.5 * j) for j in range(k)]
    return pb.TokenLogprob(token_id=tok, logprob=-0.5, top=top, rank=2)
