"""A NIXL transfer peer in its own process, driven over a pipe by the two-process tests.

The child owns a NixlTransferBackend and a seeded random pool (the parent rebuilds the same
pool from the seed to check bytes). Between commands it polls its sender and receiver, with
the pipe's wait as back-off, and keeps every result until the parent asks for it.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from typing import Any

MODEL = "test-model"
SHAPE = (3, 4, 2, 16, 64)  # kv heads, layers, K/V, block_size, head_dim: 96 KiB fp32 blocks


def make_pool(num_blocks: int, seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *SHAPE), generator=g)


def block_digest(pool: Any, ids: list[int]) -> list[str]:
    return [hashlib.sha256(pool[i].numpy().tobytes()).hexdigest() for i in ids]


def _serve(conn: Any, name: str, num_blocks: int, seed: int, model: str) -> None:
    from kvtransfer import KVCompat, KVTransferConfig, NixlTransferBackend

    pool = make_pool(num_blocks, seed)
    backend = NixlTransferBackend(KVTransferConfig(agent_name=name))
    meta = backend.register_pool(pool, KVCompat.for_pool(pool, model))
    conn.send(meta.to_bytes())
    results: dict[str, dict[str, Any]] = {}

    def pump() -> None:
        for r in backend.sender.poll() + backend.receiver.poll():
            results[r.request_id] = {
                "status": r.status.name,
                "blocks": r.num_blocks,
                "error": r.error,
                "elapsed_s": r.elapsed_s,
            }

    while True:
        pump()
        if not conn.poll(0.0005):
            continue
        cmd, *args = conn.recv()
        try:
            if cmd == "add_peer":
                reply: Any = backend.add_peer(args[0])
            elif cmd == "expect":
                rid, ids, timeout_s = args
                backend.receiver.expect(rid, ids, deadline=time.monotonic() + timeout_s)
                reply = "ok"
            elif cmd == "send":
                rid, peer, pairs, final = args
                backend.sender.send(rid, peer, pairs, final=final)
                reply = "ok"
            elif cmd == "wait":
                rids, timeout_s = args
                end = time.monotonic() + timeout_s
                while not set(rids) <= results.keys() and time.monotonic() < end:
                    pump()
                    time.sleep(0.0005)
                reply = {rid: results.pop(rid, None) for rid in rids}
            elif cmd == "digest":
                reply = block_digest(pool, args[0])
            elif cmd == "stats":
                reply = {
                    "outstanding": backend.sender.num_outstanding_writes,
                    "send_active": backend.sender.num_active,
                    "recv_active": backend.receiver.num_active,
                }
            elif cmd == "exit":
                backend.close()
                conn.send("bye")
                return
            else:
                reply = RuntimeError(f"unknown command {cmd!r}")
        except Exception as e:  # sent back to the test, which re-raises it
            reply = e
        conn.send(reply)


@dataclass
class PeerProcess:
    """Handle of a child peer: its process, the pipe, its metadata."""

    name: str
    seed: int
    num_blocks: int
    process: Any
    conn: Any
    metadata: bytes = b""

    @classmethod
    def start(cls, name: str, num_blocks: int, seed: int, model: str = MODEL) -> PeerProcess:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_serve,
            args=(child, name, num_blocks, seed, model),
            name=f"kv-peer-{name}",
            daemon=True,
        )
        proc.start()
        child.close()
        return cls(name, seed, num_blocks, proc, parent)

    def ready(self, timeout_s: float = 60.0) -> PeerProcess:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"peer {self.name} did not start")
        self.metadata = self.conn.recv()
        return self

    def call(self, *cmd: Any, timeout_s: float = 30.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"peer {self.name} did not answer {cmd[0]!r}")
        reply = self.conn.recv()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def kill(self) -> None:
        """SIGKILL this child (by its pid) and reap it."""
        if self.process.is_alive():
            os.kill(self.process.pid, 9)
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit", timeout_s=10)
            except (TimeoutError, EOFError, OSError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.kill()
