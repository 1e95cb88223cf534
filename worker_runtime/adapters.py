"""The LoRA adapters a worker serves by name (`Worker.LoadLoRAAdapter` / `UnloadLoRAAdapter`,
and `--lora-modules` at start): the asyncio side's table, published in the worker's etcd
registration. The engine holds the weights (`LLMEngine.add_lora` / `remove_lora`); this table
says which name a router may ask for and from which path.

Contract: a path is checked against --allowed-model-paths before anything at it is looked at;
the registration is republished before `load` / `unload` return, so a router sees the change
as soon as it hears back."""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable

from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest, lora_id_for
from proto import pdserve_pb2 as pb
from worker_runtime.grpc_errors import NotFound
from worker_runtime.host_cores import off_the_loop
from worker_runtime.paths import AllowedPaths


class ServedAdapters:
    def __init__(
        self,
        engine: LLMEngine,
        call: Callable[..., Awaitable],
        paths: AllowedPaths,
        republish: Callable[[], Awaitable[None]],
    ) -> None:
        self._engine = engine
        self._call = call  # WorkerRuntime.call: run on the engine thread
        self._paths = paths
        self._republish = republish
        self.by_name: dict[str, str] = dict(engine.config.lora_modules)
        """Adapters served here, name -> path (--lora-modules, then the admin RPCs)."""

    def serves_path(self, path: str) -> bool:
        """Whether an adapter is served from `path` (its path was checked when it was added)."""
        return path in self.by_name.values()

    async def load(self, name: str, path: str) -> None:
        """Load an adapter (off the event loop: disk) and serve it under `name`; LoRAError
        (a ValueError) if it cannot be used, PermissionDenied outside --allowed-model-paths,
        NotFound for a path that is not a directory."""
        if not path:
            raise ValueError("lora_path must not be empty")
        self._paths.check(path, "LoRA adapter")  # before anything at the path is looked at
        if not os.path.isdir(path):
            raise NotFound(f"No adapter found for LoRA adapter {name!r}: {path} is not a directory")
        served = self.by_name.get(name)
        if served is not None and served != path:
            raise ValueError(
                f"LoRA adapter {name!r} is already served from {served}; unload it first"
            )
        await off_the_loop(
            functools.partial(self._engine.add_lora, LoRARequest(name, lora_id_for(name), path))
        )
        self.by_name[name] = path
        await self._republish()

    async def unload(self, name: str) -> bool:
        """Stop serving an adapter and drop it from the engine (requests running with it
        finish with it); False if it was not served here."""
        found = self.by_name.pop(name, None) is not None
        lora_id = lora_id_for(name)
        await self._call(lambda e: e.remove_lora(lora_id), cancellable=False)
        await self._republish()
        return found

    def to_pb(self) -> list[pb.LoRAAdapter]:
        return [pb.LoRAAdapter(name=n, path=p) for n, p in sorted(self.by_name.items())]
