"""The split path's handover under load: from the prefill worker's last KV write complete to
the first token handed to the decode worker's stream (`pdserve_worker_kv_handover_seconds`,
with the prefill worker's part of it: `..._handover_prefill_seconds`),
at several request rates — issue 58's target: p50 <= 5 ms, p99 <= 20 ms at 0.5-4 req/s.

  python benchmarks/handover_bench.py [--rates 0.5,1,2,4] [--requests 40] [--cores 0,1]
      [--input-len-range 256,1024] [--output-len 32]

One `pdserve up --prefill 1 --decode 1` (every prompt prefilled remotely), then one
`pdserve bench --worker-metrics up` per rate: its report's handover and push figures are the
workers' own histograms over that rate's requests (docs/bench.md, `kv_transfer`).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from bench_cluster import add_pinned_args, bench_completions, pinned_worker_flags, stop_pinned
from split_ttft import start_up


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", default="0.5,1,2,4", help="requests per second")
    parser.add_argument("--requests", type=int, default=40, help="requests per rate")
    parser.add_argument("--input-len-range", default="256,1024")
    parser.add_argument("--output-len", type=int, default=32)
    add_pinned_args(parser)
    args = parser.parse_args()
    flags = pinned_worker_flags(args, "2GiB")
    work = Path(tempfile.mkdtemp(prefix="pdserve-handover-"))
    proc, url = start_up(True, args.cores, work, flags)
    rows = []
    try:
        env = {**os.environ, "PDSERVE_CACHE": str(work / "cache-split")}  # up's run file
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            summary = bench_completions(
                url, work / f"rate-{rate}.json", "--worker-metrics", "up",
                "--num-requests", str(args.requests), "--request-rate", str(rate),
                "--input-len-range", args.input_len_range, "--output-len", str(args.output_len),
                "--ignore-eos", "--seed", str(100 + i), env=env,
            )  # fmt: skip
            rows.append((rate, summary))
            print(f"rate {rate}: {summary['kv_transfer']}", flush=True)
    finally:
        stop_pinned(proc)
    print(f"\n1P+1D, every prompt remote; logs in {work}")
    print(
        f"{'req/s':>6} {'done':>5} {'handover p50':>13} {'p99':>8} {'P part p50':>11} "
        f"{'p99':>8} {'pushes':>7} {'MiB/push':>9} {'TTFT p50':>9} {'TTFT p99':>9}"
    )
    for rate, s in rows:
        kv = s["kv_transfer"]

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}ms"

        mib = "-" if kv["bytes_per_transfer"] is None else f"{kv['bytes_per_transfer'] / 2**20:.1f}"
        print(
            f"{rate:>6g} {s['completed']:>5} {ms(kv['handover_ms_p50']):>13} "
            f"{ms(kv['handover_ms_p99']):>8} {ms(kv['handover_prefill_ms_p50']):>11} "
            f"{ms(kv['handover_prefill_ms_p99']):>8} {kv['transfers']:>7} {mib:>9} "
            f"{ms(s['ttft_ms']['p50']):>9} {ms(s['ttft_ms']['p99']):>9}"
        )


if __name__ == "__main__":
    main()
