"""KV transfer matrix (docs/benchmarks/kvtransfer.md): push, peer pull and transfers between
tensor-parallel sizes, as GB/s and as a ratio to a memcpy of the same bytes, with the NIXL
descriptors each request posted — for 256 / 2k / 8k-token requests, from fresh and from
fragmented block pools, all in one run.

    python benchmarks/kv_tp_transfer.py [--tokens 256,2048,8192] [--reps 3]

Layout: the default model's (30 layers, 3 KV heads, head_dim 64, float32, 16-token blocks:
737,280 B per block). The decode worker(s) D are a child process — D(TP=1) one pool, D(TP=2)
rank 0 plus rank 1's `RankAgent` (heads [0, 2) and [2, 3)) — polling their receivers; the
prefill workers P(TP=1) and P(TP=2) (rank 1 a `RankAgent` again) are this process. Block ids
come from the engine's block pool (engine/kv/block_pool.py `reserve`): "fresh" is a new pool,
"fragmented" one after churn (requests of 1-32 blocks taken and given back in random order,
half of them as cached prefixes, about half of the pool still held). Modes:

- push: P(1) -> D(1), the request's blocks in batches of 2,048 tokens (one per engine step of
  a chunked prefill; the last one final);
- pull: P(1) -> D(1) in one final batch (a peer pull's `SendBlocks`, without its gRPC call and
  engine steps: benchmarks/kv_pull_bench.py measures those);
- P(2)->D(1), P(1)->D(2), P(2)->D(2): one final batch, each destination rank receiving its
  heads.

A request's time runs from its first `send` to the sender reporting COMPLETE (for a TP=2
sender: after rank 1's report and the batch notification). memcpy: one contiguous copy of the
request's bytes in this process (ctypes.memmove, best of 3 per repetition), the ceiling of one
copy stream (CMA, which UCX uses on one host, is one copy stream too).
Descriptors: NIXL descriptors posted per request, all of the sender's ranks together.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import random
import time
from types import SimpleNamespace
from typing import Any

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
RANGES = [(0, 2), (2, 3)]  # head_split of 3 KV heads over 2 ranks
BLOCK_BYTES = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 4
PUSH_BATCH_TOKENS = 2048
MODES = ("push", "pull", "P2->D1", "P1->D2", "P2->D2")
_IDS = itertools.count()


def _pool(blocks: int, heads: int, seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn((blocks, heads, LAYERS, 2, BLOCK, HEAD_DIM), generator=g)


def _compat() -> Any:
    from kvtransfer import KVCompat

    return KVCompat("bench", "float32", BLOCK, LAYERS, HEADS, HEAD_DIM)


def _worker(name: str, tp: int, blocks: int, seed: int) -> tuple[Any, Any]:
    """A worker's backend (rank 0) and, at TP=2, the contexts of its in-process rank 1."""
    from kvtransfer import KVTransferConfig, NixlTransferBackend
    from kvtransfer.heads import HeadRange
    from kvtransfer.rank_agent import RankLink

    link, rank1 = None, None
    if tp == 2:
        lo, hi = RANGES[1]
        rank1 = SimpleNamespace(rank=1, kv_cache=_pool(blocks, hi - lo, seed + 100), services={})

        def call(task: Any) -> Any:
            out = task.run_on_rank(rank1)
            return [out] if task.gather else None

        link = RankLink([HeadRange(*r) for r in RANGES], call)
    heads = HEADS if tp == 1 else RANGES[0][1] - RANGES[0][0]
    backend = NixlTransferBackend(KVTransferConfig(agent_name=name), link)
    backend.register_pool(_pool(blocks, heads, seed), _compat())
    return backend, rank1


def _close(backend: Any, rank1: Any) -> None:
    backend.close()
    if rank1 is not None:
        for service in rank1.services.values():
            service.close()


def _decode(conn: Any, blocks: int) -> None:
    """D(TP=1) and D(TP=2): publish metadata, expect what the parent asks, poll."""
    workers = {tp: _worker(f"bench-d{tp}", tp, blocks, 2) for tp in (1, 2)}
    conn.send({tp: b.metadata().to_bytes() for tp, (b, _) in workers.items()})
    while True:
        while not conn.poll(0.0002):
            for backend, _ in workers.values():
                backend.receiver.poll()
        msg = conn.recv()
        if msg is None:
            break
        tp, rid, ids = msg
        end = time.monotonic() + 30
        while workers[tp][0].receiver.num_active and time.monotonic() < end:
            workers[tp][0].receiver.poll()  # the previous request is reported first
        workers[tp][0].receiver.expect(rid, ids, deadline=time.monotonic() + 120)
        conn.send("ok")
    for backend, rank1 in workers.values():
        _close(backend, rank1)


def block_ids(num_blocks: int, n: int, fragmented: bool, seed: int) -> list[int]:
    """n block ids as the engine's pool hands them out: fresh, or after churn."""
    from engine.kv.block_pool import BlockPool

    pool = BlockPool(num_blocks)
    if fragmented:
        rng = random.Random(seed)
        held: list[list[int]] = []
        for i in range(400):
            k = rng.randint(1, 32)
            if pool.num_free_blocks - k > n + (num_blocks - n) // 2:
                got = pool.reserve(k)
                assert got is not None
                held.append(got)
            if held and rng.random() < 0.45:
                ids = held.pop(rng.randrange(len(held)))
                if rng.random() < 0.5:  # a computed prompt: its blocks stay cached
                    for j, b in enumerate(ids):
                        pool.cache_block(0, f"{seed}:{i}:{j}".encode(), b)
                pool.release(list(reversed(ids)))  # tables are given back leaves first
    ids = pool.reserve(n)
    assert ids is not None
    return ids


def _descriptors(backend: Any, rank1: Any) -> int | None:
    """NIXL descriptors posted so far by the worker's ranks (None: not counted, old code)."""
    transfers = getattr(backend.sender.metrics, "transfers", None)
    if transfers is None:
        return None
    total = transfers.descriptors
    if rank1 is not None and "kv_rank_agent" in rank1.services:
        total += rank1.services["kv_rank_agent"].writer.descriptors_posted
    return total


def _request(
    p: Any, d_conn: Any, d_tp: int, local: list[int], remote: list[int], batch_blocks: int
) -> float:
    rid = f"m-{next(_IDS)}"
    d_conn.send((d_tp, rid, remote))
    assert d_conn.poll(60) and d_conn.recv() == "ok", "the decode process did not answer"
    pairs = list(zip(local, remote))
    start = time.perf_counter()
    for i in range(0, len(pairs), batch_blocks):
        final = i + batch_blocks >= len(pairs)
        p.sender.send(rid, f"bench-d{d_tp}", pairs[i : i + batch_blocks], final=final)
    while not (done := p.sender.poll()):
        pass
    elapsed = time.perf_counter() - start
    assert done[0].status.name == "COMPLETE", done
    return elapsed


class Memcpy:
    """One copy stream of n bytes between two buffers touched beforehand (ctypes.memmove:
    no intra-op thread team to wait for on a busy machine)."""

    def __init__(self, nbytes: int) -> None:
        import torch

        self._src = torch.empty(nbytes, dtype=torch.uint8).random_()
        self._dst = torch.zeros_like(self._src)

    def seconds(self, nbytes: int, reps: int) -> float:
        import ctypes

        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            ctypes.memmove(self._dst.data_ptr(), self._src.data_ptr(), nbytes)
            best = min(best, time.perf_counter() - t0)
        return best


def run(tokens: list[int], reps: int) -> list[dict[str, Any]]:
    most = -(-max(tokens) // BLOCK)
    blocks = 2 * most + 16
    ctx = mp.get_context("spawn")
    d_conn, d_child = ctx.Pipe()
    d = ctx.Process(target=_decode, args=(d_child, blocks), daemon=True)
    d.start()
    rows = []
    memcpy = Memcpy(most * BLOCK_BYTES)
    try:
        metas = d_conn.recv()
        prefill = {tp: _worker(f"bench-p{tp}", tp, blocks, 1) for tp in (1, 2)}
        for backend, _ in prefill.values():
            for meta in metas.values():
                backend.add_peer(meta)
        plans = {
            "push": (1, 1, PUSH_BATCH_TOKENS // BLOCK),
            "pull": (1, 1, None),
            "P2->D1": (2, 1, None),
            "P1->D2": (1, 2, None),
            "P2->D2": (2, 2, None),
        }
        for n_tokens in tokens:
            n = -(-n_tokens // BLOCK)
            for fragmented in (False, True):
                local = block_ids(blocks, n, fragmented, seed=1)
                remote = block_ids(blocks, n, fragmented, seed=2)
                for p_tp, d_tp, batch in plans.values():  # warm-up (first write after wire-up)
                    _request(prefill[p_tp][0], d_conn, d_tp, local[:1], remote[:1], 1)
                times: dict[str, list[float]] = {m: [] for m in MODES}
                descs: dict[str, int | None] = {}
                copies = []
                for _ in range(reps):  # interleaved: every mode sees the same machine load
                    for mode, (p_tp, d_tp, batch) in plans.items():
                        p, rank1 = prefill[p_tp]
                        before = _descriptors(p, rank1)
                        times[mode].append(
                            _request(p, d_conn, d_tp, local, remote, batch or len(local))
                        )
                        after = _descriptors(p, rank1)
                        descs[mode] = None if before is None or after is None else after - before
                    copies.append(memcpy.seconds(n * BLOCK_BYTES, 3))
                nbytes = n * BLOCK_BYTES
                mem_gbps = nbytes / min(copies) / 1e9
                for mode in MODES:
                    gbps = nbytes / min(times[mode]) / 1e9
                    rows.append(
                        dict(
                            tokens=n_tokens,
                            blocks=n,
                            pool="fragmented" if fragmented else "fresh",
                            mode=mode,
                            gbps=gbps,
                            memcpy_gbps=mem_gbps,
                            ratio=gbps / mem_gbps,
                            descriptors=descs[mode],
                            runs=_runs(local, remote),
                        )
                    )
                    _print(rows[-1])
        for backend, rank1 in prefill.values():
            _close(backend, rank1)
    finally:
        d_conn.send(None)
        d.join(30)
    return rows


def _runs(local: list[int], remote: list[int]) -> int:
    """Runs of pairs adjacent on both sides, the pairs ordered by source block."""
    pairs = sorted(zip(local, remote))
    return 1 + sum(1 for (a, b), (c, e) in zip(pairs, pairs[1:]) if not (c == a + 1 and e == b + 1))


def _print(r: dict[str, Any]) -> None:
    d = "-" if r["descriptors"] is None else str(r["descriptors"])
    print(
        f"{r['tokens']:>5} tok {r['blocks']:>4} blk {r['pool']:<10} {r['mode']:<7} "
        f"{r['gbps']:6.2f} GB/s  memcpy {r['memcpy_gbps']:6.2f}  ratio {r['ratio']:5.2f}x  "
        f"descriptors {d:>7}  block runs {r['runs']}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="256,2048,8192")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    rows = run([int(t) for t in args.tokens.split(",")], args.reps)
    worst = min(r["ratio"] for r in rows)
    load = os.getloadavg()[0]
    print(f"worst ratio {worst:.2f}x memcpy (target >= 0.9x); load average {load:.2f}")


if __name__ == "__main__":
    main()
