"""What the HTTP surface (router/http/, router/endpoints/) needs from a running router. server.py's
`RouterServices` is the real one; the app knows only this, so router's modules import one
way: server -> app -> services."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any, Callable, Protocol, TypeVar

from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.endpoints.admin.fleet import FleetAdmin
from router.endpoints.loras.serving import LoRAAdapters
from router.generation.logprobs import TokenText
from router.generation.model_card import ModelCard
from router.generation.structured import Grammars
from router.http.auth import Keys
from router.http.key_limits import KeyLimits
from router.metrics import RouterMetrics
from router.placement.hint import HintSeal
from router.placement.registry import WorkerRegistry

T = TypeVar("T")


class Services(Protocol):
    config: RouterConfig
    keys: Keys  # the API and admin keys (router/http/auth.py), resolved at start
    key_limits: KeyLimits  # per-API-key concurrency slots and token buckets
    card: ModelCard  # tokenizer, names, the fallback context length
    registry: WorkerRegistry  # /health counts its ready workers
    metrics: RouterMetrics
    dispatcher: Dispatcher  # runs each prompt on the cluster
    tokens: TokenText  # token texts and bytes for responses
    loras: LoRAAdapters  # the LoRA adapters served (models beside the base), load / unload
    admin: FleetAdmin  # fleet-wide sleep / wake up / weight updates; gates generation
    grammars: Grammars  # structured-output constraints compile-checked (time-limited)
    hint_seal: HintSeal  # the endpoint picker's placement hints: sealed, then opened

    async def tokenizing(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` (parsing and tokenizing a body of `size` bytes): on the tokenizer
        threads when the body is large, inline (cheaper) when it is small."""

    def max_model_len(self) -> int:
        """The longest prompt + output a decode worker holds now."""

    def update_gauges(self) -> None:
        """Bring the worker and KV-index gauges up to date (before /metrics renders)."""

    def lifespan(self, app: Any) -> AbstractAsyncContextManager[None]:
        """Starts the background work (etcd watch, KV subscriptions) and stops it."""
