"""KV block transfer between two processes (NIXL/UCX) against the single-process memcpy.

    python benchmarks/kv_transfer.py            # 16/64/256-token blocks; 1, 64, 512 MiB
    python benchmarks/kv_transfer.py --quick    # 16/64-token blocks; 1, 64 MiB
    python benchmarks/kv_transfer.py --ids fresh  # block ids from the engine's pool (runs)

This process is the sender (prefill worker) and a spawned child the receiver (decode worker).
Each request writes `total` bytes of blocks from random local ids to random remote ids (or,
`--ids fresh|fragmented`, ids as the engine's block pool hands them out), in 8
batches (the last carries the notification that completes it), as a prefill worker would;
the same request in 1 batch is reported beside it (per-batch cost: a flush + notification).
Its time runs from the first `send` in this process to the moment the receiver's `poll()`
reports COMPLETE (both read CLOCK_MONOTONIC). The baseline copies the same scattered blocks
inside one process, block by block (`dst[r].copy_(src[l])`), with 1 thread and with all of
torch's threads; the faster is the ceiling the ratio is taken against. The per-request
overhead is the latency of a 1-block request with its notification, receiver polling with a
back-off capped at 50 us (an engine loop polls once per step instead). Pools use transparent
huge pages unless --no-thp (CMA pins the receiver's pages: 4 KiB pages roughly halve its
speed, and memcpy's too). Each row also says how many NIXL descriptors a request posted (one per
run of blocks adjacent on both sides). Results are printed and written to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20
MODEL_SHAPE = dict(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M
RESULTS = Path(__file__).resolve().parent / "results" / "kv_transfer.json"


def _pool(
    num_blocks: int,
    block_tokens: int,
    device: str,
    fill: float,
    kv_cache_dtype: str = "auto",
    model_dtype: str = "float32",
) -> Any:
    """The default model's pool as the engine allocates it for `kv_cache_dtype`
    (engine/kv/kv_format.py: fp8 / int8 storage, int8 rows 4 bytes longer)."""
    import torch

    from engine.kv import kv_format

    storage = kv_format.storage_dtype(kv_cache_dtype, getattr(torch, model_dtype))
    shape = (
        num_blocks,
        MODEL_SHAPE["num_kv_heads"],
        MODEL_SHAPE["num_layers"],
        2,
        block_tokens,
        kv_format.stored_head_dim(kv_cache_dtype, MODEL_SHAPE["head_dim"]),
    )
    pool = torch.empty(shape, dtype=storage, device=device)
    if pool.element_size() == 1:  # fp8 has no CPU fill kernel: fill the bytes
        pool.view(torch.uint8).fill_(int(fill) & 0xFF)
        return pool
    return pool.fill_(fill)  # pages touched


def _digest(block: Any) -> str:
    import torch

    raw = block.contiguous().view(torch.uint8)  # numpy has no bf16 / fp8: hash the bytes
    return hashlib.sha256(raw.cpu().numpy().tobytes()).hexdigest()


def _backend(name: str, pool: Any, kv_cache_dtype: str = "auto") -> Any:
    from kvtransfer import KVCompat, KVTransferConfig, NixlTransferBackend

    backend = NixlTransferBackend(KVTransferConfig(agent_name=name))
    backend.register_pool(pool, KVCompat.for_pool(pool, "smollm2-135m", kv_cache_dtype))
    return backend


def _receiver(conn: Any, device: str) -> None:
    """Child: one backend per setup (block size, and optionally KV cache dtype and model
    dtype); `expect` then `wait` reports the completion time."""
    from kvtransfer.polling import Backoff

    backend = pool = None
    while True:
        cmd, *args = conn.recv()
        if cmd == "setup":
            if backend is not None:
                backend.close()
            pool = None
            pool = _pool(args[0], args[1], device, 0.0, *args[2:])
            backend = _backend("-".join(map(str, ("bench-recv", *args[1:]))), pool, *args[2:3])
            conn.send(backend.metadata().to_bytes())
        elif cmd == "expect":
            backend.receiver.expect(args[0], args[1], deadline=time.monotonic() + 60)
            conn.send("ok")
        elif cmd == "wait":
            backoff = Backoff(min_s=5e-6, max_s=50e-6)
            while not (results := backend.receiver.poll()):
                backoff.sleep()
            conn.send((time.monotonic(), results[0].status.name, results[0].num_bytes))
        elif cmd == "checksum":
            conn.send(_digest(pool[args[0]]))
        elif cmd == "exit":
            if backend is not None:
                backend.close()
            conn.send("bye")
            return


class Bench:
    def __init__(self, device: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver, args=(child, device), daemon=True)
        self.proc.start()
        self.device = device
        self.seq = 0

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return self.conn.recv()

    def transfer(
        self, backend: Any, peer: str, local: list[int], remote: list[int], batches: int
    ) -> tuple[float, float]:
        """One request; returns (end-to-end seconds, sender-local completion seconds)."""
        self.seq += 1
        rid = f"bench-{self.seq}"
        self.call("expect", rid, remote)
        self.conn.send(("wait",))
        pairs = list(zip(local, remote))
        size = math.ceil(len(pairs) / batches)
        t0 = time.monotonic()
        for i in range(0, len(pairs), size):
            backend.sender.send(rid, peer, pairs[i : i + size], final=i + size >= len(pairs))
        while not (done := backend.sender.poll()):
            time.sleep(20e-6)
        t_sent = time.monotonic()
        t_recv, status, _ = self.conn.recv()
        assert done[0].status.name == "COMPLETE" and status == "COMPLETE", (done, status)
        return t_recv - t0, t_sent - t0

    def close(self) -> None:
        self.call("exit")
        self.proc.join(10)


def memcpy_s(src: Any, dst: Any, local: list[int], remote: list[int], threads: int) -> float:
    """Seconds to copy the scattered blocks once inside this process."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        for lo, re in zip(local, remote):
            dst[re].copy_(src[lo])
        if dst.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)


def _ids(ids: str, num_blocks: int, n: int, seed: int) -> list[int]:
    """n block ids: 'random' (a permutation's first n), or as the engine's block pool hands
    them out, 'fresh' or 'fragmented' (benchmarks/kv_tp_transfer.py `block_ids`)."""
    import torch

    if ids == "random":
        return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[
            :n
        ].tolist()
    from kv_tp_transfer import block_ids

    return block_ids(num_blocks, n, ids == "fragmented", seed)


def _descriptors(backend: Any) -> int | None:
    """NIXL descriptors the sender posted so far (None: not counted, older code)."""
    transfers = getattr(backend.sender.metrics, "transfers", None)
    return None if transfers is None else transfers.descriptors


def run(
    block_tokens_list: list[int],
    totals_mib: list[int],
    reps: int,
    lat_iters: int,
    device: str,
    ids: str = "random",
) -> dict[str, Any]:
    import torch

    bench = Bench(device)
    rows, latency = [], {}
    try:
        for block_tokens in block_tokens_list:
            block_bytes = 30 * 2 * block_tokens * 3 * 64 * 4
            most = max(math.ceil(t * MIB / block_bytes) for t in totals_mib)
            num_blocks = most + most // 4 + 1
            meta = bench.call("setup", num_blocks, block_tokens)
            src = _pool(num_blocks, block_tokens, device, 1.0)
            for i in range(0, num_blocks, 64):
                src[i : i + 64] += torch.arange(i, min(i + 64, num_blocks), device=device).view(
                    -1, 1, 1, 1, 1, 1
                )
            dst = _pool(num_blocks, block_tokens, device, 0.0)
            backend = _backend(f"bench-send-{block_tokens}", src)
            peer = backend.add_peer(meta)
            bench.transfer(backend, peer, [0], [0], 1)  # warm: first write after wire-up
            for total in totals_mib:
                n = math.ceil(total * MIB / block_bytes)
                local = _ids(ids, num_blocks, n, seed=2 * total)
                remote = _ids(ids, num_blocks, n, seed=2 * total + 1)
                threads = torch.get_num_threads()
                memcpy_s(src, dst, local, remote, threads)  # warm-up
                e2e, snd, bulk, one, alln = [], [], [], [], []
                descs_before = _descriptors(backend)
                for _ in range(reps):  # interleaved, so that all see the same machine load
                    a, b = bench.transfer(backend, peer, local, remote, 8)
                    e2e.append(a)
                    snd.append(b)
                    bulk.append(bench.transfer(backend, peer, local, remote, 1)[0])
                    one.append(memcpy_s(src, dst, local, remote, 1))
                    alln.append(memcpy_s(src, dst, local, remote, threads))
                check = bench.call("checksum", remote[-1])
                assert check == _digest(src[local[-1]]), "received bytes differ"
                descs_after = _descriptors(backend)
                descriptors = (
                    None
                    if descs_before is None or descs_after is None
                    else (descs_after - descs_before) / (2 * reps)
                )
                nbytes = n * block_bytes
                one_gbps, all_gbps = nbytes / min(one) / 1e9, nbytes / min(alln) / 1e9
                best_nixl = nbytes / min(e2e) / 1e9
                rows.append(
                    dict(
                        block_tokens=block_tokens,
                        block_bytes=block_bytes,
                        total_mib=total,
                        blocks=n,
                        nixl_gbps_best=best_nixl,
                        nixl_gbps_median=nbytes / statistics.median(e2e) / 1e9,
                        sender_done_gbps_best=nbytes / min(snd) / 1e9,
                        nixl_1_batch_gbps_best=nbytes / min(bulk) / 1e9,
                        memcpy_1t_gbps=one_gbps,
                        memcpy_all_gbps=all_gbps,
                        ratio_vs_memcpy=best_nixl / max(one_gbps, all_gbps),
                        descriptors_per_request=descriptors,
                        ids=ids,
                    )
                )
                _print_row(rows[-1])
            if block_tokens == block_tokens_list[0]:
                e2e, snd = zip(
                    *(bench.transfer(backend, peer, [1], [2], 1) for _ in range(lat_iters))
                )
                latency = dict(
                    block_bytes=block_bytes,
                    iterations=lat_iters,
                    e2e_us_p50=1e6 * statistics.median(e2e),
                    e2e_us_p99=1e6 * sorted(e2e)[int(0.99 * (len(e2e) - 1))],
                    sender_done_us_p50=1e6 * statistics.median(snd),
                )
            backend.close()
            del src, dst
    finally:
        bench.close()
    return dict(
        device=device,
        threads=torch.get_num_threads(),
        cpus=os.cpu_count(),
        ucx_net_devices=os.environ.get("UCX_NET_DEVICES"),
        thp=os.environ.get("THP_MEM_ALLOC_ENABLE") == "1",
        rows=rows,
        latency_1_block=latency,
    )


def _print_row(r: dict[str, Any]) -> None:
    print(
        f"{r['block_tokens']:>4} tok {r['block_bytes'] / MIB:6.2f} MiB/blk "
        f"{r['total_mib']:>4} MiB {r['blocks']:>5} blk | nixl {r['nixl_gbps_best']:6.2f} GB/s "
        f"(median {r['nixl_gbps_median']:5.2f}; 1 batch {r['nixl_1_batch_gbps_best']:5.2f})"
        f" | memcpy 1t {r['memcpy_1t_gbps']:5.2f} all {r['memcpy_all_gbps']:5.2f} GB/s"
        f" | ratio {r['ratio_vs_memcpy']:5.1%}"
        f" | {r['ids']} ids, descriptors/request "
        f"{'-' if r['descriptors_per_request'] is None else r['descriptors_per_request']}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run (a few seconds)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (VRAM pools)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument(
        "--no-thp",
        action="store_true",
        help="plain 4 KiB pages for the pools (default: transparent huge pages)",
    )
    ap.add_argument(
        "--json",
        type=Path,
        default=None,
        help="where to write the results (default: benchmarks/results/kv_transfer*.json)",
    )
    ap.add_argument(
        "--ids",
        choices=("random", "fresh", "fragmented"),
        default="random",
        help="block ids: a random permutation (default), or from the engine's block pool, "
        "fresh or after allocation churn (runs of adjacent blocks move as one descriptor)",
    )
    args = ap.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    # torch reads this at its first CPU allocation (here and in the spawned receiver): large
    # allocations get madvise(MADV_HUGEPAGE), as the engine should do for its KV pool.
    os.environ["THP_MEM_ALLOC_ENABLE"] = "0" if args.no_thp else "1"
    if args.quick:
        out = run([16, 64], [1, 64], args.reps or 5, 50, args.device, args.ids)
    else:
        out = run([16, 64, 256], [1, 64, 512], args.reps or 15, 300, args.device, args.ids)
    lat = out["latency_1_block"]
    print(
        f"1-block request ({lat['block_bytes']} B) with notification: "
        f"p50 {lat['e2e_us_p50']:.0f} us, p99 {lat['e2e_us_p99']:.0f} us end-to-end; "
        f"sender done p50 {lat['sender_done_us_p50']:.0f} us ({lat['iterations']} requests)"
    )
    big = [r for r in out["rows"] if r["total_mib"] >= 64]
    if big:
        print(
            f"worst ratio at >= 64 MiB: {min(r['ratio_vs_memcpy'] for r in big):.1%} "
            "(target >= 80%)"
        )
    out["load_average"] = os.getloadavg()
    path = args.json or RESULTS.with_name(
        f"kv_transfer{'_quick' if args.quick else ''}{'_4k' if args.no_thp else ''}"
        f"{'' if args.ids == 'random' else '_' + args.ids}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"load average {out['load_average'][0]:.2f}; written to {path}")


if __name__ == "__main__":
    main()
