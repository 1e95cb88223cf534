"""KV-slice transfer cost per request between tensor-parallel sizes (docs/kvtransfer.md):
a 256-token prompt's blocks (16 x 16 tokens, the default model's layout: 30 layers, 3 KV heads,
head_dim 64, float32) from a prefill worker at TP=2 into a decode worker at TP=1, against the
same request TP=1 -> TP=1, measured in the same run.

    python benchmarks/kv_tp_transfer.py [--requests 30] [--tokens 256]

Processes: the decode worker D is a child (its own NIXL agent, polling its receiver); the
prefill worker's rank 0 is this process and its rank 1 another child that runs the real
`RankAgent` (kvtransfer/rank_agent.py), told what to write over a pipe as a worker's group
channel would tell it. A request's time runs from the sender's `send` (one final batch of all
blocks) to the sender reporting COMPLETE — for TP=2 that includes rank 1's report and the
batch notification rank 0 sends once every part is done. TP=2 -> TP=1 moves each block as
strided head slices (2 + 1 heads: 30 x 2 x 16 rows of 512 B and 256 B per block, one NIXL
descriptor each) where TP=1 -> TP=1 moves one 737,280-byte descriptor per block.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import statistics
import time
from types import SimpleNamespace

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
RANGES = [(0, 2), (2, 3)]  # head_split of 3 KV heads over 2 ranks
_IDS = itertools.count()


def _pool(blocks: int, heads: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn((blocks, LAYERS, 2, BLOCK, heads, HEAD_DIM), generator=g)


def _compat():
    from kvtransfer import KVCompat

    return KVCompat("bench", "float32", BLOCK, LAYERS, HEADS, HEAD_DIM)


def _decode(conn, blocks: int) -> None:
    """D (tp 1): register, publish metadata, then expect whatever the parent asks for."""
    from kvtransfer import KVTransferConfig, NixlTransferBackend

    backend = NixlTransferBackend(KVTransferConfig(agent_name="bench-d"))
    conn.send(backend.register_pool(_pool(blocks, HEADS, 2), _compat()).to_bytes())
    while True:
        while not conn.poll(0.0002):
            backend.receiver.poll()
        msg = conn.recv()
        if msg is None:
            break
        rid, ids = msg
        end = time.monotonic() + 10
        while backend.receiver.num_active and time.monotonic() < end:  # the last one reported
            backend.receiver.poll()
        backend.receiver.expect(rid, ids, deadline=time.monotonic() + 30)
        conn.send("ok")
    backend.close()


def _rank1(conn, blocks: int) -> None:
    """Rank 1 of the TP=2 prefill worker: run the group channel's messages."""
    lo, hi = RANGES[1]
    ctx = SimpleNamespace(rank=1, kv_cache=_pool(blocks, hi - lo, 1), services={})
    while True:
        task = conn.recv()
        if task is None:
            break
        result = task.run_on_rank(ctx)
        if task.gather:
            conn.send([result])
    for service in ctx.services.values():
        service.close()


def _prefill(tp: int, d_meta: bytes, blocks: int, rank1_conn=None):
    from kvtransfer import KVTransferConfig, NixlTransferBackend
    from kvtransfer.heads import HeadRange
    from kvtransfer.rank_agent import RankLink

    link = None
    if tp == 2:

        def call(task):
            rank1_conn.send(task)
            return rank1_conn.recv() if task.gather else None

        link = RankLink([HeadRange(*r) for r in RANGES], call)
    heads = HEADS if tp == 1 else RANGES[0][1] - RANGES[0][0]
    backend = NixlTransferBackend(KVTransferConfig(agent_name=f"bench-p{tp}"), link)
    backend.register_pool(_pool(blocks, heads, 1), _compat())
    backend.add_peer(d_meta)
    return backend


def _run(backend, d_conn, tp: int, requests: int, n_blocks: int, blocks: int) -> list[float]:
    import random

    rng = random.Random(tp)
    times = []
    for i in range(requests + 2):  # two warm-up requests
        local = rng.sample(range(blocks), n_blocks)
        remote = rng.sample(range(blocks), n_blocks)
        rid = f"tp{tp}-{next(_IDS)}"
        d_conn.send((rid, remote))
        assert d_conn.poll(30) and d_conn.recv() == "ok", "the decode process did not answer"
        start = time.perf_counter()
        backend.sender.send(rid, "bench-d", list(zip(local, remote)), final=True)
        while True:
            done = backend.sender.poll()
            if done:
                break
        elapsed = time.perf_counter() - start
        assert done[0].status.name == "COMPLETE", done
        if i >= 2:
            times.append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    n_blocks, blocks = -(-args.tokens // BLOCK), 128
    ctx = mp.get_context("spawn")
    d_conn, d_child = ctx.Pipe()
    r_conn, r_child = ctx.Pipe()
    d = ctx.Process(target=_decode, args=(d_child, blocks), daemon=True)
    r1 = ctx.Process(target=_rank1, args=(r_child, blocks), daemon=True)
    d.start()
    r1.start()
    d_meta = d_conn.recv()
    one = _prefill(1, d_meta, blocks)
    two = _prefill(2, d_meta, blocks, r_conn)
    results = {}
    for _ in range(2):  # interleaved rounds: both see the same machine state
        for tp, backend in ((1, one), (2, two)):
            results.setdefault(tp, []).extend(
                _run(backend, d_conn, tp, args.requests // 2, n_blocks, blocks)
            )
    for backend in (one, two):
        backend.close()
    r_conn.send(None)
    d_conn.send(None)
    r1.join(10)
    d.join(10)
    med = {tp: statistics.median(t) * 1e3 for tp, t in results.items()}
    mb = n_blocks * LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 4 / 1e6
    print(
        f"{args.tokens}-token prompt: {n_blocks} blocks, {mb:.1f} MB, {args.requests} requests each"
    )
    for tp in (1, 2):
        t = sorted(results[tp])
        print(
            f"  P(TP={tp}) -> D(TP=1): median {med[tp]:.2f} ms  (min {t[0] * 1e3:.2f}, "
            f"max {t[-1] * 1e3:.2f})"
        )
    print(f"  ratio TP=2->1 / TP=1->1: {med[2] / med[1]:.2f}x")


if __name__ == "__main__":
    main()
