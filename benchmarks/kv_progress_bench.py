"""What the KV transfer-progress thread costs the compute beside it (kvtransfer/progress.py).

    python benchmarks/kv_progress_bench.py            # 3 s per case

A long prompt computing on a prefill worker while its request to the decode worker is open
(no write outstanding), and a decode worker listening for that prompt's KV: the progress
thread polls real NIXL backends (two agents in this process) while one torch thread runs a
fixed matmul loop, the prefill's compute stand-in. Cases, in one run, interleaved:

* `none`: no progress thread (the ceiling);
* `1ms`: the old pace — every millisecond while anything is in flight;
* `adaptive`: today's pace (listening receiver: back-off to 5 ms; open sender with nothing
  outstanding: back-off to 0.5 s, keepalives on time);
* `... P only`: only the prefill worker's thread (the decode worker's runs in its own process
  in a real cluster: it costs CPU there, not this process's GIL).

Printed per case: the compute's throughput (best of the rounds) relative to `none`'s best, the
progress threads' polling rounds per second, and the process's CPU seconds per second. Then
what listening costs a transfer: a 1-block write's completion on P (which needs D to poll:
UCX's peer error-handling mode) after D's thread has listened quietly for 0.2-0.3 s, at the old
pace and today's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _backends() -> tuple[Any, Any]:
    import torch

    from kvtransfer import KVCompat, KVTransferConfig, NixlTransferBackend

    out = []
    for name in ("progress-p", "progress-d"):
        pool = torch.zeros((16, 3, 30, 2, 16, 64))
        b = NixlTransferBackend(KVTransferConfig(agent_name=f"{name}-{os.getpid()}"))
        b.register_pool(pool, KVCompat.for_pool(pool, "smollm2-135m", "auto"))
        b._bench_pool = pool  # type: ignore[attr-defined]
        out.append(b)
    out[0].add_peer(out[1].metadata())
    return out[0], out[1]


def _compute(seconds: float) -> tuple[float, float]:
    """(matmuls per second on one torch thread, process CPU seconds per wall second)."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    n, c0, t0 = 0, time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a = torch.tanh(a @ a)  # Python between ops: the GIL changes hands as in an engine
        n += 20
    wall = time.perf_counter() - t0
    return n / wall, (time.process_time() - c0) / wall


def _completion_after_quiet(
    p_send: Any, d_send: Any, d_recv: Any, peer: str, pace: dict[str, float], samples: int
) -> list[float]:
    """Seconds from P's `send` of one block to P's COMPLETE, each after D's progress thread has
    listened to an idle request for 0.2-0.3 s (P's write completes only once D polled)."""
    import random

    from kvtransfer.progress import TransferProgress

    d_thread = TransferProgress([d_send, d_recv], **pace)
    d_thread.start()
    out = []
    try:
        for i in range(samples):
            rid = f"quiet-{i}-{random.random()}"
            d_recv.expect(rid, [2], idle_s=60.0)
            time.sleep(random.uniform(0.2, 0.3))
            t0 = time.perf_counter()
            p_send.send(rid, peer, [(2, 2)], final=True)
            while not p_send.poll():
                time.sleep(20e-6)
            out.append(time.perf_counter() - t0)
            end = time.monotonic() + 10
            while not d_recv.poll() and time.monotonic() < end:
                time.sleep(0.001)
    finally:
        d_thread.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--samples", type=int, default=20, help="writes timed after a quiet spell")
    args = ap.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from kvtransfer.poll_split import split_receiver, split_sender
    from kvtransfer.progress import TransferProgress

    p, d = _backends()
    p_send, _ = split_sender(p.sender, "pull:")
    p_recv, _ = split_receiver(p.receiver, "pull:")
    d_recv, _ = split_receiver(d.receiver, "pull:")
    d_send, _ = split_sender(d.sender, "pull:")
    results: dict[str, list[tuple[float, float, float]]] = {}
    seq = 0
    for _ in range(args.rounds):
        for case in ("none", "1ms", "adaptive", "1ms P only", "adaptive P only"):
            seq += 1
            rid = f"bench-{seq}"
            d_recv.expect(rid, [0, 1], idle_s=60.0)
            p_send.send(rid, d.agent_name, [], final=False, idle_s=60.0)  # open, nothing out
            threads = []
            if case != "none":
                fast = (
                    dict(listen_period_s=0.001, idle_period_s=0.001)
                    if case.startswith("1ms")
                    else {}
                )
                threads = [TransferProgress([p_send, p_recv], **fast)]  # the prefill worker's
                if not case.endswith("P only"):  # the decode worker's (its own process, really)
                    threads.append(TransferProgress([d_send, d_recv], **fast))
                for t in threads:
                    t.start()
            rate, cpu = _compute(args.seconds)
            rounds = sum(t.rounds for t in threads) / args.seconds
            for t in threads:
                t.stop()
            p_send.send(rid, d.agent_name, [(0, 0)], final=True)
            end = time.monotonic() + 10
            got = 0
            while got < 2 and time.monotonic() < end:
                got += len(p_send.poll()) + len(d_recv.poll())
                time.sleep(0.001)
            assert got == 2, "the request did not complete"
            results.setdefault(case, []).append((rate, cpu, rounds))
    base = max(r[0] for r in results["none"])
    for case, rows in results.items():
        rate = max(r[0] for r in rows)
        cpu = min(r[1] for r in rows)
        rounds = statistics.median([r[2] for r in rows])
        print(
            f"{case:>15}: compute {rate / base:6.1%} of no thread | progress rounds "
            f"{rounds:7.1f}/s (its threads together) | process CPU {cpu:5.2f} s/s"
        )
    for case, pace in (
        ("1ms", dict(listen_period_s=0.001, idle_period_s=0.001)),
        ("adaptive", {}),
    ):
        lat = _completion_after_quiet(p_send, d_send, d_recv, d.agent_name, pace, args.samples)
        print(
            f"{case:>15}: a 1-block write after D listened quietly for 0.2-0.3 s completes on "
            f"P in p50 {1e3 * statistics.median(lat):.2f} ms, max {1e3 * max(lat):.2f} ms "
            f"({len(lat)} writes)"
        )
    print(f"load average {os.getloadavg()[0]:.2f}")
    p.close()
    d.close()


if __name__ == "__main__":
    main()
