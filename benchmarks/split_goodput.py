"""Where the split should win: long prompts and long answers at a steady rate — 1 prefill + 1
decode worker against one colocated worker on the same cores, as `pdserve up` starts them on
a small host (1P+1D: one thread each; colocated: one worker on every core). Issue 58's target:
goodput (TTFT <= 2 s and every inter-token gap <= 100 ms) >= 1.0x colocated, ITL p99 <= 0.5x —
and, from the measurements, which topology `pdserve up` picks by default on a small host.

  python benchmarks/split_goodput.py [--rates 0.5,1,2] [--requests 24] [--cores 0,1]
      [--input-len-range 2048,4096] [--output-len-range 128,256] [--num-layers N]
      [--slo-ttft-ms 2000] [--slo-itl-ms 100]

Each configuration is one `pdserve up` at its defaults (the router places every prompt; these
are all long enough to go to the prefill pool), serving the rates in the order given with
`pdserve bench` (Poisson arrivals, random token prompts, --ignore-eos; one seed per rate,
the same in both configurations). Printed per rate: goodput, TTFT p50/p99, ITL p99 of each
configuration and the split's ratios against colocated. On a small CPU host the full model
cannot meet a 2 s TTFT for 2-4k-token prompts at all; `--num-layers` shortens the model in
both configurations alike (a shape with the same per-token work split, faster steps).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench_cluster import (
    add_pinned_args,
    bench_completions,
    pinned_worker_flags,
    start_pinned,
    stop_pinned,
)

CONFIGS = {"colocated": False, "split": True}
"""name -> one prefill worker? Threads per worker: the cores shared out, as `pdserve up` does."""


def run_rates(name: str, args: argparse.Namespace, work: Path) -> dict[float, dict]:
    """One cluster of configuration `name`; `pdserve bench` at every rate; the summaries."""
    split = CONFIGS[name]
    threads = max(1, len(args.cores.split(",")) // (2 if split else 1))
    flags = [f"--worker-arg={f}" for f in pinned_worker_flags(args, "2GiB")]
    proc, url = start_pinned(
        name, args.cores, work, split=split, up_args=flags, num_threads=threads
    )
    out: dict[float, dict] = {}
    try:
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            out[rate] = bench_completions(
                url, work / f"{name}-{rate}.json",
                "--num-requests", str(args.requests), "--request-rate", str(rate),
                "--input-len-range", args.input_len_range,
                "--output-len-range", args.output_len_range, "--ignore-eos",
                "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-itl-ms", str(args.slo_itl_ms),
                "--seed", str(200 + i),
            )  # fmt: skip
            print(f"{name} at {rate} req/s: {_row(out[rate])}", flush=True)
    finally:
        stop_pinned(proc)
    return out


def _row(s: dict) -> str:
    return (
        f"goodput {s['goodput']:.2f} req/s ({s['good_requests']}/{s['completed']}), "
        f"TTFT p50 {_ms(s['ttft_ms']['p50'])} p99 {_ms(s['ttft_ms']['p99'])}, "
        f"ITL p99 {_ms(s['itl_ms']['p99'])}"
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f} ms"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "-"
    return "inf" if b == 0 and a > 0 else "-" if b == 0 else f"{a / b:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", default="0.5,1,2", help="requests per second")
    parser.add_argument("--requests", type=int, default=24, help="requests per rate")
    parser.add_argument("--input-len-range", default="2048,4096")
    parser.add_argument("--output-len-range", default="128,256")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000)
    parser.add_argument("--slo-itl-ms", type=float, default=100)
    add_pinned_args(parser)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pdserve-split-goodput-"))
    results = {name: run_rates(name, args, work) for name in CONFIGS}
    print(
        f"\n{args.requests} requests per rate, prompts {args.input_len_range} tokens, "
        f"outputs {args.output_len_range}; SLO TTFT <= {args.slo_ttft_ms:g} ms, "
        f"ITL <= {args.slo_itl_ms:g} ms; logs in {work}"
    )
    for rate in results["colocated"]:
        c, s = results["colocated"][rate], results["split"][rate]
        print(f"\n{rate:g} req/s\n  colocated: {_row(c)}\n  1P+1D:     {_row(s)}")
        print(
            f"  1P+1D / colocated: goodput {_ratio(s['goodput'], c['goodput'])}, "
            f"TTFT p99 {_ratio(s['ttft_ms']['p99'], c['ttft_ms']['p99'])}, "
            f"ITL p99 {_ratio(s['itl_ms']['p99'], c['itl_ms']['p99'])}"
        )


if __name__ == "__main__":
    main()
