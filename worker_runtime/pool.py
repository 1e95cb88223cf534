"""The engine's KV pool as the transfer agent knows it: registered at start, deregistered
before a sleep frees it, registered again (a new address, new metadata) on wake-up."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtransfer import KVCompat, KVTransferBackend
from kvtransfer.metadata import PeerMetadata

if TYPE_CHECKING:  # annotations only: the engine (torch) is the runtime's to import
    from engine.llm_engine import LLMEngine


class PoolRegistration:
    """`register` / `deregister` run on the engine thread (the pool is the engine's);
    `metadata` is what the registration publishes (None while the pool sleeps)."""

    def __init__(self, kv: KVTransferBackend, compat: KVCompat) -> None:
        self._kv = kv
        self._compat = compat
        self.metadata: PeerMetadata | None = None

    @property
    def registered(self) -> bool:
        return self.metadata is not None

    def register(self, engine: LLMEngine) -> None:
        """Register the pool where it lives now."""
        self.metadata = self._kv.register_pool(engine.kv_cache, self._compat)

    def deregister(self) -> None:
        """Before the pool's memory is freed: nothing is published for it until `register`."""
        self._kv.deregister_pool()
        self.metadata = None
