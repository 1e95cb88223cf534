"""The loop ranks 1..N-1 of a tensor-parallel group run (started by group.py, spec on stdin):
join the group, then handle rank 0's messages in order — load the model's shard, allocate the
KV pool (rank 0's block count: block ids are the same on every rank), run each step's forward
(step.py), release, exit. Any error exits non-zero (rank 0 notices: group.py); so does the
death of rank 0 (its parent: polled every second)."""

from __future__ import annotations

import gc
import logging
import os
import pickle
import sys
import threading
import time

import torch
from torch import nn

from engine.parallel.communicator import DistributedCommunicator
from engine.parallel.group import AllocatePool, LoadModel, RankSpec, Release, Shutdown
from engine.parallel.shard import TPShard
from engine.parallel.step import StepInputs, copy_blocks, forward
from engine.runner.device import keep_freed_host_memory

log = logging.getLogger("engine.parallel.rank_worker")


class RankEngine:
    """One engine's shard on this rank: model, attention backend, KV pool."""

    def __init__(self, config, spec: RankSpec, comm: DistributedCommunicator) -> None:
        from engine.attention.selector import fused_kernels, make_attention_backend
        from engine.models.layers import pack_linears
        from engine.models.loader import load_model
        from engine.runner.device import resolve_device_dtype

        self.config = config
        device, self.dtype = resolve_device_dtype(config)
        self.device = torch.device("cuda", spec.rank) if device.type == "cuda" else device
        shard = TPShard(spec.rank, spec.size, config.enable_expert_parallel)
        self.loaded = load_model(
            config.model, self.dtype, self.device, config.num_layers, shard=shard
        )
        self.model = self.loaded.model
        self.model.use_communicator(comm)
        self.backend = make_attention_backend(config.attention_backend, self.device)
        self.model.use_fused_kernels(fused_kernels(self.backend.name, self.device))
        assert isinstance(self.model, nn.Module)  # every CausalLM is one
        pack_linears(self.model)  # as rank 0's runner does
        self.kv_cache: torch.Tensor | None = None
        self.rank = spec.rank
        self.services: dict[str, object] = {}
        """What `RankTask` messages keep on this rank (the KV transfer agent), closed on release."""

    def close(self) -> None:
        for service in self.services.values():
            close = getattr(service, "close", None)
            if close is not None:
                close()
        self.services.clear()

    def allocate(self, num_blocks: int) -> None:
        from engine.kv.kv_pool import allocate_kv_pool

        self.kv_cache = allocate_kv_pool(
            num_blocks,
            self.loaded.args,
            self.config.block_size,
            self.dtype,
            self.device,
            self.config.kv_cache_dtype,
        )

    @torch.inference_mode()
    def run(self, step: StepInputs) -> None:
        assert self.kv_cache is not None, "a step before AllocatePool"
        if step.block_copies:
            copy_blocks(self.kv_cache, step.block_copies)
        if step.num_tokens:
            forward(self.model, self.backend, self.kv_cache, step)


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def serve(spec: RankSpec) -> None:
    torch.set_num_threads(spec.threads)
    threading.Thread(target=_exit_with_parent, args=(spec.parent_pid,), daemon=True).start()
    device = torch.device("cuda", spec.rank) if spec.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the same host-memory setting as rank 0's engine (its prefill activations alike)
        keep_freed_host_memory()
    comm = DistributedCommunicator(spec.rank, spec.size, spec.port, spec.timeout_s, device)
    engine: RankEngine | None = None
    while True:
        message = comm.broadcast_payload()
        if isinstance(message, StepInputs):
            assert engine is not None, "a step before LoadModel"
            engine.run(message)
        elif isinstance(message, LoadModel):
            engine = RankEngine(message.config, spec, comm)
        elif isinstance(message, AllocatePool):
            assert engine is not None, "AllocatePool before LoadModel"
            engine.allocate(message.num_blocks)
        elif hasattr(message, "run_on_rank"):  # a RankTask (group.py)
            result = message.run_on_rank(engine)
            if message.gather:
                comm.gather_payload(result)
        elif isinstance(message, Release):
            if engine is not None:
                engine.close()
            engine = None
            gc.collect()
        elif isinstance(message, Shutdown):
            if engine is not None:
                engine.close()
            break
        else:
            raise TypeError(f"unknown message {type(message).__name__}")
    comm.close()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-rank %(levelname)s %(message)s")
    spec: RankSpec = pickle.load(sys.stdin.buffer)
    try:
        serve(spec)
    except Exception:
        log.exception("tensor-parallel rank %d failed", spec.rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
