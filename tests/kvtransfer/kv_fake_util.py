"""Factories for the fake-transport tests (a backend with a seeded pool; one engine step)."""

import torch

from kvtransfer import FakeTransferBackend, KVCompat, KVTransferConfig, TransferStatus

SHAPE = (2, 2, 2, 4, 8)  # kv heads, layers, K/V, block_size, head_dim
S = TransferStatus


def make(fabric, name, blocks, seed, model="m", **config):
    pool = torch.randn((blocks, *SHAPE), generator=torch.Generator().manual_seed(seed))
    backend = FakeTransferBackend(fabric, KVTransferConfig(agent_name=name, **config))
    backend.register_pool(pool, KVCompat.for_pool(pool, model))
    return backend, pool


def step(*backends):
    """One engine step on every backend: {("send"|"recv", request_id): result}."""
    out = {}
    for b in backends:
        for r in b.sender.poll():
            out[("send", r.request_id)] = r
        for r in b.receiver.poll():
            out[("recv", r.request_id)] = r
    return out
