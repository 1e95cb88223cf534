"""Where the time of one large coalesced KV write goes over NIXL/UCX on one host.

    python benchmarks/kv_region_bench.py                 # 256 / 2k / 8k tokens, default UCX
    python benchmarks/kv_region_bench.py --tokens 8192 --variants default,split2,threads2

One request = one region: blocks 0..n-1 of the sender's pool into blocks 0..n-1 of the
receiver's (as a fresh pool's adjacent runs coalesce), SmolLM2-135M-shaped KV (30 layers, 3 KV
heads, head_dim 64, fp32, 16-token blocks: 45 KiB per token). Every variant runs in its own pair
of processes (UCX reads its environment once) and measures, interleaved in the same run:

* `nixl`: `sender.send(..., final=True)` -> the receiver's `poll()` reports COMPLETE (both
  read CLOCK_MONOTONIC), the receiver polling with a 50 us back-off;
* `post`: the time inside the posting call alone (UCX copies with CMA inside it);
* `memcpy 1t`: libc memcpy of the same bytes between two warm buffers of the sender process
  (one thread), and `torch 2t`: torch's copy with every thread (the faster is the ceiling the
  NIXL ratio is taken against: `ratio`);
* `kernel 1t`: process_vm_writev into a buffer of this process itself (one thread; the kernel's
  copy loop CMA runs, without UCX) — the copy CMA is bounded by;
* `shm 1t`: libc memcpy into a warm memfd MAP_SHARED mapping (4 KiB shmem pages) — what a
  sender would reach writing a peer's pool that lives in shared memory (another process can
  map it through /proc/<pid>/fd/<n>): the user-space single copy CMA is not.

Variants: `default` (the backend's settings: one transfer through `sender.send`), `split<k>`
(the region posted as k raw NIXL transfers, one after another, in one thread), `threads<k>`
(k transfers posted from k threads at once, the UCX backend with `num_workers=k`),
`nixlthreads<k>` (one transfer, the UCX backend with `num_threads=k`), and
`env:NAME=VALUE[+NAME=VALUE]` (UCX settings, e.g. `env:UCX_PROTO_INFO=y` prints the protocols
UCX picked). Split and threaded variants send the receiver's batch notification once every
part is done.
Pools use transparent huge pages (THP_MEM_ALLOC_ENABLE=1), as the engine's pool does.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

TOKEN_BYTES = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M, fp32
BLOCK_TOKENS = 16
RESULTS = Path(__file__).resolve().parent / "results" / "kv_region_bench.json"


def _pool(num_blocks: int, fill: float) -> Any:
    import torch

    return torch.full((num_blocks, 3, 30, 2, BLOCK_TOKENS, 64), fill, dtype=torch.float32)


def _ucx_params(params: dict[str, str]) -> None:
    """Make this process's NIXL agents with these UCX backend parameters (e.g. num_workers)."""
    from nixl import _bindings
    from nixl._api import nixl_agent, nixl_agent_config

    import kvtransfer.nixl_backend as nb

    def make_agent(name: str, config: Any) -> tuple[Any, type]:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        agent.create_backend("UCX", params)
        return agent, _bindings.nixlRemoteDisconnectError

    nb.make_agent = make_agent  # type: ignore[assignment]


def _backend(name: str, pool: Any, num_workers: int = 1) -> Any:
    from kvtransfer import KVCompat, KVTransferConfig, NixlTransferBackend

    if num_workers > 1:
        _ucx_params({"num_workers": str(num_workers)})
    backend = NixlTransferBackend(KVTransferConfig(agent_name=name))
    backend.register_pool(pool, KVCompat.for_pool(pool, "smollm2-135m", "auto"))
    return backend


def _receiver(conn: Any, num_blocks: int, env: dict[str, str]) -> None:
    os.environ.update(env)
    from kvtransfer.polling import Backoff

    pool = _pool(num_blocks, 0.0)
    backend = _backend(f"region-recv-{os.getpid()}", pool)
    conn.send(backend.metadata().to_bytes())
    while True:
        cmd, *args = conn.recv()
        if cmd == "expect":
            backend.receiver.expect(args[0], args[1], deadline=time.monotonic() + 120)
            conn.send("ok")
        elif cmd == "wait":
            if args and args[0]:
                time.sleep(args[0])  # not polling: does the sender complete meanwhile?
            backoff = Backoff(min_s=5e-6, max_s=50e-6)
            while not (results := backend.receiver.poll()):
                backoff.sleep()
            conn.send((time.monotonic(), results[0].status.name))
        elif cmd == "sum":
            conn.send(float(pool[: args[0]].double().sum()))
        elif cmd == "exit":
            backend.close()
            conn.send("bye")
            return


def _libc() -> Any:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.memcpy.restype = ctypes.c_void_p
    libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return libc


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _kernel_copy_s(libc: Any, dst: int, src: int, nbytes: int) -> float:
    """process_vm_writev into our own memory, in 1 GiB pieces (the syscall's iovec limit)."""
    pid = os.getpid()
    t0 = time.perf_counter()
    done = 0
    while done < nbytes:
        n = min(nbytes - done, 1 << 30)
        local, remote = _IoVec(src + done, n), _IoVec(dst + done, n)
        wrote = libc.process_vm_writev(
            pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, ctypes.c_ulong(0)
        )
        if wrote <= 0:
            raise OSError(ctypes.get_errno(), "process_vm_writev failed")
        done += wrote
    return time.perf_counter() - t0


def _post_chunks(backend: Any, peer: str, n: int, k: int, threads: bool, notif: bytes) -> float:
    """The region as k transfers (raw NIXL, sequential or from k threads); waits for each."""
    import numpy as np

    t = backend.transport
    agent = t._agent
    bounds = [round(i * n / k) for i in range(k + 1)]
    handles: list[Any] = [None] * k

    def post(i: int) -> None:
        ids = np.arange(bounds[i], bounds[i + 1], dtype=np.int32)
        h = agent.make_prepped_xfer(
            "WRITE", t._local, ids, t._remote[peer], ids, notif + str(i).encode()
        )
        agent.transfer(h)
        while agent.check_xfer_state(h) == "PROC":
            time.sleep(20e-6)
        handles[i] = h

    t0 = time.perf_counter()
    if threads:
        ts = [threading.Thread(target=post, args=(i,)) for i in range(k)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
    else:
        for i in range(k):
            post(i)
    spent = time.perf_counter() - t0
    for h in handles:
        h.release()
    return spent


def _variant(conn: Any, variant: str, tokens: list[int], reps: int) -> None:
    """Child: one variant's sender (and its receiver, spawned with the same environment)."""
    env: dict[str, str] = {}
    if variant.startswith("env:"):
        for kv in variant[4:].split("+"):
            name, _, value = kv.partition("=")
            env[name] = value
    os.environ.update(env)
    import torch

    from kvtransfer.nixl_slices import PART_NOTIF  # receivers drop these: parts of a batch
    from kvtransfer.protocol import BatchNotice

    workers = int(variant[7:]) if variant.startswith("threads") else 1
    if variant.startswith("nixlthreads"):
        _ucx_params({"num_threads": variant[11:]})
    num_blocks = max(tokens) // BLOCK_TOKENS + 1
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(there, num_blocks, env), daemon=True)
    proc.start()
    rows = []
    try:
        meta = here.recv()
        src = _pool(num_blocks, 1.0)
        src += torch.arange(num_blocks, dtype=torch.float32).view(-1, 1, 1, 1, 1, 1)
        dst = _pool(num_blocks, 0.0)
        backend = _backend(f"region-send-{os.getpid()}", src, workers)
        peer = backend.add_peer(meta)
        libc = _libc()
        shm_fd = os.memfd_create("kv-region-bench")
        os.ftruncate(shm_fd, dst.numel() * 4)
        shm = mmap.mmap(shm_fd, dst.numel() * 4, mmap.MAP_SHARED)
        shm_t = torch.frombuffer(shm, dtype=torch.uint8)
        shm_t.fill_(0)  # pages touched, as a live pool's are
        seq = 0
        for tok in tokens:
            n = tok // BLOCK_TOKENS
            nbytes = n * src[0].numel() * 4
            ids = list(range(n))
            nixl, post, mem1, tor, kern, shm1 = [], [], [], [], [], []
            for rep in range(reps + 1):  # the first round warms up, and is dropped
                seq += 1
                rid = f"r{seq}"
                here.send(("expect", rid, ids))
                here.recv()
                here.send(("wait", 0.0))
                if variant.startswith(("split", "threads")):
                    k = int(variant[5:] if variant.startswith("split") else variant[7:])
                    t0 = time.monotonic()
                    threads = variant.startswith("threads")
                    post_s = _post_chunks(backend, peer, n, k, threads, PART_NOTIF)
                    # every part is done (landed): the receiver's batch notification, alone
                    notice = BatchNotice(rid, 0, tuple(ids), n).encode()
                    backend.transport.send_notif(peer, notice)
                else:
                    t0 = time.monotonic()
                    p0 = time.perf_counter()
                    backend.sender.send(rid, peer, list(zip(ids, ids)), final=True)
                    post_s = time.perf_counter() - p0
                    while not backend.sender.poll():
                        time.sleep(20e-6)
                t_recv, status = here.recv()
                assert status == "COMPLETE", status
                m0 = time.perf_counter()
                libc.memcpy(dst.data_ptr(), src.data_ptr(), nbytes)
                m1 = time.perf_counter()
                torch.set_num_threads(os.cpu_count() or 1)
                dst[:n].copy_(src[:n])
                m2 = time.perf_counter()
                k_s = _kernel_copy_s(libc, dst.data_ptr(), src.data_ptr(), nbytes)
                s0 = time.perf_counter()
                libc.memcpy(shm_t.data_ptr(), src.data_ptr(), nbytes)
                s_s = time.perf_counter() - s0
                if rep:
                    nixl.append(t_recv - t0)
                    post.append(post_s)
                    mem1.append(m1 - m0)
                    tor.append(m2 - m1)
                    kern.append(k_s)
                    shm1.append(s_s)
            here.send(("sum", n))
            got = here.recv()
            want = float(src[:n].double().sum())
            assert got == want, f"received bytes differ ({got} != {want})"
            base = min(min(mem1), min(tor))
            row = dict(
                variant=variant,
                tokens=tok,
                mib=nbytes / 2**20,
                nixl_gbps=nbytes / min(nixl) / 1e9,
                nixl_gbps_median=nbytes / statistics.median(nixl) / 1e9,
                post_gbps=nbytes / min(post) / 1e9,
                memcpy_1t_gbps=nbytes / min(mem1) / 1e9,
                torch_all_gbps=nbytes / min(tor) / 1e9,
                kernel_1t_gbps=nbytes / min(kern) / 1e9,
                shm_1t_gbps=nbytes / min(shm1) / 1e9,
                ratio=min(base, 1e9) / min(nixl),
                ratio_vs_1t=min(mem1) / min(nixl),
            )
            rows.append(row)
            print(
                f"{variant:>24} {tok:>5} tok {row['mib']:6.1f} MiB | nixl {row['nixl_gbps']:5.2f} "
                f"(median {row['nixl_gbps_median']:5.2f}; in post {row['post_gbps']:5.2f}) GB/s | "
                f"memcpy 1t {row['memcpy_1t_gbps']:5.2f} torch all {row['torch_all_gbps']:5.2f} "
                f"kernel 1t {row['kernel_1t_gbps']:5.2f} shm 1t {row['shm_1t_gbps']:5.2f} GB/s | "
                f"ratio {row['ratio']:.2f}x "
                f"(vs 1t {row['ratio_vs_1t']:.2f}x)",
                flush=True,
            )
        backend.close()
        del shm_t
        shm.close()
        os.close(shm_fd)
    finally:
        here.send(("exit",))
        here.recv()
        proc.join(10)
    conn.send(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="256,2048,8192")
    ap.add_argument("--variants", default="default")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=RESULTS)
    args = ap.parse_args()
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    tokens = [int(t) for t in args.tokens.split(",")]
    ctx = mp.get_context("spawn")
    out = []
    for variant in args.variants.split(","):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_variant, args=(there, variant, tokens, args.reps))
        proc.start()
        out += here.recv()
        proc.join(30)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(rows=out, load=os.getloadavg()), indent=2))
    print(f"load average {os.getloadavg()[0]:.2f}; written to {args.json}")


if __name__ == "__main__":
    main()
