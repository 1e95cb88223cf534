"""Disaggregated (1 prefill + 1 decode worker) vs one colocated worker (the decode worker
prefilling locally) vs disaggregated with the planner (`pdserve up --prefill 1 --decode 1
--planner`: it may switch the prefill worker to decode, or back, docs/planner.md), same model,
same 2 cores (taskset), under a mixed workload: a stream of short chats plus periodic
2-4k-token prompts, at several request rates (one cluster per configuration serves the rates
in the order given, so the planner carries its pools from one rate to the next).

  python benchmarks/colocated_vs_disagg.py [--rates 0.5,1,2] [--duration 60] [--cores 0,1]
      [--modes colocated,disaggregated,planner]

Reported for the short requests (what users of a chat service feel): TTFT p90, ITL p99 and
goodput at the SLO given by --slo-ttft-ms / --slo-itl-ms. The expected gain is decode no
longer stalling behind long prefills; on 2 CPU cores the prefill worker also takes one of the
two cores away from decode, so the trade is measured, not assumed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_cluster import start_pinned

from local_cluster.run_file import control_request

MODES = ("colocated", "disaggregated", "planner")
LABELS = {"colocated": "colocated", "disaggregated": "disaggregated", "planner": "disagg+planner"}


def _start_up(
    mode: str, cores: str, work: Path, model_flags: list[str], planner_flags: list[str]
) -> tuple[subprocess.Popen, str]:
    split = mode in ("disaggregated", "planner")
    # The bundled model is prepared under the default cache; point this run at the same files.
    model = subprocess.run(
        [sys.executable, "-m", "pdserve", "prepare-model"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return start_pinned(
        mode,
        cores,
        work,
        split=split,
        num_threads=1 if split else len(cores.split(",")),
        up_args=[
            "--model",
            model,
            *[f"--worker-arg={f}" for f in model_flags],
            *(planner_flags if mode == "planner" else []),
        ],
        start_timeout_s=300,
    )


def _planner_pools(work: Path) -> str:
    """The planner's pools now (from its `up`'s control port), e.g. "0P+2D"."""
    run = json.loads((work / "cache-planner" / "run" / "current-cluster.json").read_text())
    pools = json.loads(control_request(run))["planner"]["pools"]
    return f"{pools['prefill']}P+{pools['decode']}D"


def _bench(url: str, out: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.bench",
            "--url",
            url,
            "--endpoint",
            "chat",
            "--no-progress",
            "--out",
            str(out),
            *flags,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", default="0.5,1,2", help="short-chat requests/s")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per rate")
    parser.add_argument("--long-rate", type=float, default=0.1, help="2-4k-token prompts/s")
    parser.add_argument("--cores", default="0,1")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000)
    parser.add_argument("--slo-itl-ms", type=float, default=250)
    parser.add_argument(
        "--num-layers", type=int, default=None, help="truncate the model (smoke runs)"
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help="configurations to run, in order: colocated, disaggregated, planner",
    )
    parser.add_argument(
        "--worker-arg",
        dest="worker_args",
        action="append",
        default=[],
        help="extra flag for every worker in every configuration, "
        "e.g. --worker-arg=--itl-target-ms=0",
    )
    parser.add_argument(
        "--planner-arg",
        dest="planner_args",
        action="append",
        default=[],
        help="extra `pdserve up` flag for the planner configuration, e.g. "
        "--planner-arg=--planner-interval=2",
    )
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes: choose from {', '.join(MODES)}")
    model_flags = ["--kv-cache-memory=1GiB", "--max-num-batched-tokens=512", *args.worker_args]
    if args.num_layers:
        model_flags.append(f"--num-layers={args.num_layers}")
    planner_flags = [
        "--planner",
        f"--ttft-slo-ms={args.slo_ttft_ms}",
        f"--itl-slo-ms={args.slo_itl_ms}",
        *args.planner_args,
    ]
    work = Path(tempfile.mkdtemp(prefix="pdserve-colo-"))
    rows = []
    for mode in modes:
        proc, url = _start_up(mode, args.cores, work, model_flags, planner_flags)
        try:
            # A seed pair per rate (the same in every mode): no rate re-sends an earlier rate's
            # prompts, so prefix-cache hits never flatter a later run.
            for i, rate in enumerate(float(r) for r in args.rates.split(",")):
                n_short = max(4, int(rate * args.duration))
                n_long = max(1, int(args.long_rate * args.duration))
                short_out, long_out = (
                    work / f"{mode}-{rate}-short.json",
                    work / f"{mode}-{rate}-long.json",
                )
                longs = _bench(
                    url,
                    long_out,
                    "--num-requests",
                    str(n_long),
                    "--request-rate",
                    str(args.long_rate),
                    "--input-len-range",
                    "2000,4000",
                    "--output-len",
                    "16",
                    "--seed",
                    str(2 * i + 2),
                    "--timeout",
                    str(args.duration * 3),
                )
                shorts = _bench(
                    url,
                    short_out,
                    "--num-requests",
                    str(n_short),
                    "--request-rate",
                    str(rate),
                    "--input-len-range",
                    "32,128",
                    "--output-len",
                    "64",
                    "--ignore-eos",
                    "--slo-ttft-ms",
                    str(args.slo_ttft_ms),
                    "--slo-itl-ms",
                    str(args.slo_itl_ms),
                    "--seed",
                    str(2 * i + 1),
                    "--timeout",
                    str(args.duration * 3),
                )
                shorts.wait()
                longs.wait()
                doc = json.loads(short_out.read_text())["summary"]
                rows.append((mode, rate, doc))
                pools = f", pools now {_planner_pools(work)}" if mode == "planner" else ""
                print(
                    f"{LABELS[mode]:14s} rate {rate:4.1f}/s: TTFT p90 {doc['ttft_ms']['p90']:8.0f} "
                    "ms, "
                    f"ITL p99 {doc['itl_ms']['p99']:7.0f} ms, goodput {doc['goodput']:.2f} req/s "
                    f"({doc['completed']}/{doc['num_requests']} done){pools}",
                    flush=True,
                )
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    print(
        f"\nSLO: TTFT <= {args.slo_ttft_ms:.0f} ms and every ITL gap <= {args.slo_itl_ms:.0f} ms; "
        f"long prompts at {args.long_rate}/s alongside; cores {args.cores}"
    )
    by = {(m, r): d for m, r, d in rows}
    if "colocated" in modes and len(modes) > 1:
        others = [m for m in modes if m != "colocated"]
        print(
            f"\n{'rate':>8} | "
            + " | ".join(f"{LABELS[m] + '/colocated':>25}" for m in others)
            + " | goodput "
            + " / ".join(LABELS[m] for m in modes)
        )
        for rate in sorted({r for _, r, _ in rows}):
            c = by[("colocated", rate)]
            ratios = [_ratio(by[(m, rate)]["goodput"], c["goodput"]) for m in others]
            print(
                f"{rate:6.1f}/s | "
                + " | ".join(f"{r:>25}" for r in ratios)
                + " | "
                + " / ".join(f"{by[(m, rate)]['goodput']:.2f}" for m in modes)
            )
    shutil.rmtree(work, ignore_errors=True)


def _ratio(goodput: float, colocated: float) -> str:
    return f"{goodput / colocated:.2f}x" if colocated else ("inf" if goodput else "-")


if __name__ == "__main__":
    main()
