"""Assembly of a router: model card, worker registry + etcd watch, KV index + subscriptions,
placement, dispatcher, metrics; `serve` builds the app over them and runs it under uvicorn
until interrupted."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, TypeVar

import grpc

from cluster.chat_config import ChatConfig
from cluster.etcd_security import EtcdCredentials
from cluster.grpc_security import OPEN, ClusterAuth, resolve
from cluster.heap import freeze_startup_heap
from cluster.registration import WorkerInfo
from cluster.roles import Role
from engine.processing.tokenizer import Tokenizer
from router.channels import ChannelPool
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.endpoints.admin.fleet import FleetAdmin
from router.endpoints.loras.serving import LoRAAdapters
from router.generation.logprobs import TokenText
from router.generation.model_card import ModelCard
from router.generation.structured import Grammars
from router.http.auth import Keys, resolve_keys
from router.http.key_limits import KeyLimits
from router.http.limits import uvicorn_options
from router.metrics import RouterMetrics
from router.parsers.message import ChatOptions
from router.placement.allowed_workers import AllowedWorkers
from router.placement.events import KVSubscriptions
from router.placement.hint import HintSeal
from router.placement.index import KVIndex
from router.placement.placer import Placer
from router.placement.policy import make_policy
from router.placement.pool_signals import pool_signals
from router.placement.registry import EtcdWatcher, Refusal, WorkerRegistry

log = logging.getLogger(__name__)
T = TypeVar("T")
INLINE_BODY_BYTES = 16 << 10  # bodies up to this are parsed and tokenized on the event loop


def load_model_card(config: RouterConfig) -> ModelCard:
    """Tokenizer, chat template and context length of the served model (no weights)."""
    from engine.models.prepare import resolve_model_path
    from engine.processing.generation_config import load_generation_config, sampling_defaults

    path = resolve_model_path(config.model)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"--model must be an HF-format directory with tokenizer.json: {path}")
    hf = json.loads((path / "config.json").read_text())
    tok = Tokenizer.from_dir(path)
    if config.chat.chat_template is not None:
        tok.set_chat_template(_template_text(config.chat.chat_template))
    max_len = config.max_model_len or int(hf.get("max_position_embeddings", 2048))
    name = config.served_model_name or path.name
    defaults = sampling_defaults(
        load_generation_config(config.generation_config, tok.generation_config)
    )
    if defaults:
        log.info(
            "sampling defaults from the generation config (%s): %s",
            config.generation_config,
            defaults,
        )
    return ModelCard(
        name=name,
        tokenizer=tok,
        max_model_len=max_len,
        vocab_size=int(hf.get("vocab_size", tok.vocab_size)),
        aliases=frozenset({config.model, path.name, str(path)}),
        max_n=config.max_n,
        sampling_defaults=defaults,
        chat=chat_options(config.chat, tok),
    )


def _template_text(value: str) -> str:
    """--chat-template: a file's text, or the template itself (vLLM accepts both)."""
    file = Path(value)
    if file.is_file():
        return file.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value}: no such file (nor a Jinja template)")


def chat_options(config: ChatConfig, tok: Tokenizer) -> ChatOptions:
    """The parsers the chat flags name; an unknown name is an error at start, listing the
    known ones."""
    from router.parsers.reasoning.parser import reasoning_parser
    from router.parsers.tools.parser import load_tool_parser_plugin, tool_parser

    if config.tool_parser_plugin is not None:
        load_tool_parser_plugin(config.tool_parser_plugin)
    reasoning = reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
    markers = None
    if reasoning is not None:
        markers = (
            tuple(tok.encode(reasoning.start, add_special_tokens=False)),
            tuple(tok.encode(reasoning.end, add_special_tokens=False)),
        )
    return ChatOptions(
        auto_tool_choice=config.enable_auto_tool_choice,
        tool_parser=tool_parser(config.tool_call_parser) if config.tool_call_parser else None,
        reasoning_parser=reasoning,
        reasoning_markers=markers,
    )


class RouterServices:
    """Everything a running router owns (the app sees it as `router.services.Services`).
    Background work starts in `start` (inside the event loop) and stops in `stop`."""

    def __init__(
        self,
        config: RouterConfig,
        card: ModelCard,
        keys: Keys,
        etcd_credentials: EtcdCredentials | None = None,
        auth: ClusterAuth = OPEN,
    ) -> None:
        """`etcd_credentials` open the registry's etcd watch; `auth`: what the channels to the
        workers present. Both are resolved from the config at start (`serve`); None / open for
        a cluster that asks for nothing."""
        self.config = config
        self.card = card
        self.keys = keys
        self.etcd_credentials = etcd_credentials
        self.metrics = RouterMetrics()
        self._allowed = AllowedWorkers(config.allowed_worker_cidrs)
        self.registry = WorkerRegistry(config.stale_after_s, refusal=self._refusal)
        self.index = KVIndex()
        self.channels = ChannelPool(auth)
        self.kv_subscriptions = KVSubscriptions(self.index, self.channels)
        self.registry.add_listener(self.kv_subscriptions.on_added, self._on_removed)
        self.registry.add_weights_listener(self.kv_subscriptions.on_new_weights)
        self.placer = Placer(self.registry, self.index, make_policy(config.placement), self.metrics)
        self.dispatcher = Dispatcher(config, self.placer, self.channels, self.metrics)
        self.tokens = TokenText(card.tokenizer)
        self.loras = LoRAAdapters(self.registry, self.channels, config.lora_modules)
        self.admin = FleetAdmin(self.registry, self.channels, config.queue_timeout_s)
        limits = config.limits
        self.key_limits = KeyLimits(
            limits.max_concurrent_requests_per_key,
            limits.max_tokens_per_minute_per_key,
            on_refused=lambda reason: self.metrics.rate_limited.labels(reason.value).inc(),
            compile_seconds_per_minute=limits.max_compile_seconds_per_minute_per_key,
        )
        self.hint_seal = HintSeal()
        """Seals the endpoint picker's placement hints (router/placement/hint.py)."""
        self.grammars = Grammars(
            card.tokenizer,
            card.vocab_size,
            limits.grammar_compile_processes,
            limits.grammar_compile_timeout_s,
            limits.grammar_compile_wait_s,
            limits.max_grammar_repetitions,
            self.key_limits,
        )
        self._tokenizer_pool = ThreadPoolExecutor(
            limits.tokenizer_threads, thread_name_prefix="tokenize"
        )
        self._watch: asyncio.Task | None = None
        self._picker: grpc.aio.Server | None = None

    async def tokenizing(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        if size <= INLINE_BODY_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    def max_model_len(self) -> int:
        """The longest prompt + output a decode worker holds: the largest published by a live
        decode worker (else by any registered one, draining or stale), else the model card's."""
        decode = [w for w in self.registry.by_role(Role.DECODE) if w.info.max_model_len > 0]
        live = [w for w in self.registry.ready(Role.DECODE) if w.info.max_model_len > 0]
        return (
            max(w.info.max_model_len for w in live or decode) if decode else self.card.max_model_len
        )

    def _refusal(self, info: WorkerInfo) -> Refusal | None:
        if not (info.model_id in self.card.aliases or info.model_id == self.card.name):
            return Refusal("model", f"model {info.model_id!r} is not served here")
        address = self._allowed.refusal(info)
        return Refusal("address", address) if address is not None else None

    def _on_removed(self, info: WorkerInfo) -> None:
        self.kv_subscriptions.on_removed(info)
        if not any(w.info.grpc_address == info.grpc_address for w in self.registry.all()):
            self.channels.retire(info.grpc_address)

    async def start(self, sync_timeout_s: float = 5.0) -> None:
        watcher = EtcdWatcher(
            self.registry, self.config.etcd, self.config.cluster, credentials=self.etcd_credentials
        )
        self._watch = asyncio.create_task(watcher.run(), name="etcd-watch")
        try:
            async with asyncio.timeout(sync_timeout_s):
                await self.registry.synced.wait()
        except TimeoutError:
            log.warning("etcd at %s not reachable yet; serving 503s until it is", self.config.etcd)
        if self.config.endpoint_picker.port:
            await self._start_picker()

    async def _start_picker(self) -> None:
        """The endpoint picker (router/endpoint_picker/ext_proc.py) beside the HTTP API, over this
        router's
        registry, KV index and placement; ready (gRPC health) once etcd has synced."""
        from router.endpoint_picker.ext_proc import set_serving, start_picker_server
        from router.endpoint_picker.picker import EndpointPicker

        cfg = self.config
        endpoint = cfg.endpoint_picker.endpoint or f"{cfg.host}:{cfg.port}"  # (config.py checks)
        self._picker, checks = await start_picker_server(
            EndpointPicker(self, endpoint),
            cfg.host,
            cfg.endpoint_picker.port,
            cfg.limits.max_request_body_bytes,
        )
        log.info(
            "endpoint picker (ext_proc) on %s:%d, answering %s",
            cfg.host,
            cfg.endpoint_picker.port,
            endpoint,
        )

        async def ready() -> None:
            await self.registry.synced.wait()
            await set_serving(checks)

        self._picker_ready = asyncio.create_task(ready(), name="picker-ready")

    async def stop(self) -> None:
        if self._picker is not None:
            self._picker_ready.cancel()
            await self._picker.stop(1.0)
        if self._watch is not None:
            self._watch.cancel()
            with suppress(asyncio.CancelledError):
                await self._watch
        await self.kv_subscriptions.close()
        await self.channels.close_all()
        self.grammars.close()

    @asynccontextmanager
    async def lifespan(self, app) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    def update_gauges(self) -> None:
        now = self.registry.clock()
        counts: dict[tuple[str, str], int] = {
            (role, state): 0 for role in Role for state in ("ready", "draining", "stale")
        }
        for w in self.registry.all():
            counts[(w.info.role, self.registry.state_of(w, now))] += 1
        for (role, state), n in counts.items():
            self.metrics.workers.labels(role, state).set(n)
        refused = dict.fromkeys(("block_hash_mismatch", "model", "address"), 0)
        for refusal in self.registry.refused.values():
            refused[refusal.reason] = refused.get(refusal.reason, 0) + 1
        for reason, n in refused.items():
            self.metrics.workers_refused.labels(reason).set(n)
        self.metrics.kv_index_blocks.set(len(self.index))
        signals = pool_signals(self.registry, self.config.placement.default_prefill_rate)
        self.metrics.prefill_backlog_seconds.set(signals.prefill_backlog_s)
        self.metrics.decode_kv_usage.set(signals.decode_kv_usage)
        self.metrics.decode_waiting.set(signals.decode_waiting)


def serve(config: RouterConfig, log_level: str = "info") -> int:
    """Run until SIGTERM/SIGINT (graceful: in-flight responses finish), then exit 0."""
    import uvicorn

    from router.http.app import create_app

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:  # the app and its services are up: cluster/heap.py
                freeze_startup_heap()

        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn re-raises the signal after a graceful shutdown (exit status -15); a
            # router, like the workers, exits 0 when asked to stop.
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    keys = resolve_keys(config, os.environ)  # a refused key stops the start (exit 2)
    etcd_credentials = config.etcd_security.resolve(os.environ)  # likewise
    auth = resolve(config.grpc_security, os.environ)  # likewise a refused token or TLS file
    log.info("gRPC to the workers presents: %s", auth.describe())
    card = load_model_card(config)
    services = RouterServices(config, card, keys, etcd_credentials, auth)
    server = _Server(
        uvicorn.Config(
            create_app(services),
            host=config.host,
            port=config.port,
            log_level=log_level,
            timeout_graceful_shutdown=5,
            **uvicorn_options(config.limits),
        )
    )
    log.info(
        "router for %s on http://%s:%d (policy %s)",
        card.name,
        config.host,
        config.port,
        config.placement.policy,
    )
    asyncio.run(server.serve())
    return 0 if server.started else 1
