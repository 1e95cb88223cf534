"""Disaggregated (1 prefill + 1 decode worker) vs one colocated worker (the decode worker
prefilling locally), same model, same 2 cores (taskset), under a mixed workload: a stream of
short chats plus periodic 2-4k-token prompts, at several request rates.

  python -m benchmarks.colocated_vs_disagg [--rates 0.5,1,2] [--duration 60] [--cores 0,1]

Reported for the short requests (what users of a chat service feel): TTFT p90, ITL p99 and
goodput at the SLO given by --slo-ttft-ms / --slo-itl-ms. The expected gain is decode no
longer stalling behind long prefills; on 2 CPU cores the prefill worker also takes one of the
two cores away from decode, so the trade is measured, not assumed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


def _start_up(mode: str, cores: str, work: Path, model_flags: list[str]) -> tuple[subprocess.Popen, str]:
    prefill = "1" if mode == "disaggregated" else "0"
    threads = "1" if mode == "disaggregated" else str(len(cores.split(",")))
    env = {**os.environ, "PDSERVE_CACHE": str(work / f"cache-{mode}")}
    # The bundled model is prepared under the default cache; point this run at the same files.
    model = subprocess.run([sys.executable, "-m", "pdserve", "prepare-model"], capture_output=True,
                           text=True, check=True).stdout.strip()
    cmd = ["taskset", "-c", cores, sys.executable, "-m", "pdserve", "up", "--port", "0",
           "--prefill", prefill, "--decode", "1", "--num-threads", threads, "--model", model,
           "--log-dir", str(work / f"logs-{mode}"), *[f"--worker-arg={f}" for f in model_flags]]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    url: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            if line.startswith("pdserve is up: "):
                url.append(line.split()[3])
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(300):
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError(f"pdserve up ({mode}) did not start; logs in {work}")
    return proc, url[0]


def _bench(url: str, out: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.serving", "--url", url, "--endpoint", "chat",
         "--no-progress", "--out", str(out), *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="0.5,1,2", help="short-chat requests/s")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per rate")
    parser.add_argument("--long-rate", type=float, default=0.1, help="2-4k-token prompts/s")
    parser.add_argument("--cores", default="0,1")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000)
    parser.add_argument("--slo-itl-ms", type=float, default=250)
    parser.add_argument("--num-layers", type=int, default=None, help="truncate the model (smoke runs)")
    args = parser.parse_args()
    model_flags = ["--kv-cache-memory=1GiB", "--max-num-batched-tokens=512"]
    if args.num_layers:
        model_flags.append(f"--num-layers={args.num_layers}")
    work = Path(tempfile.mkdtemp(prefix="pdserve-colo-"))
    rows = []
    for mode in ("colocated", "disaggregated"):
        proc, url = _start_up(mode, args.cores, work, model_flags)
        try:
            for rate in (float(r) for r in args.rates.split(",")):
                n_short = max(4, int(rate * args.duration))
                n_long = max(1, int(args.long_rate * args.duration))
                short_out, long_out = work / f"{mode}-{rate}-short.json", work / f"{mode}-{rate}-long.json"
                longs = _bench(url, long_out, "--num-requests", str(n_long), "--request-rate", str(args.long_rate),
                               "--input-len-range", "2000,4000", "--output-len", "16", "--seed", "2",
                               "--timeout", str(args.duration * 3))
                shorts = _bench(url, short_out, "--num-requests", str(n_short), "--request-rate", str(rate),
                                "--input-len-range", "32,128", "--output-len", "64", "--ignore-eos",
                                "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-itl-ms", str(args.slo_itl_ms),
                                "--seed", "1", "--timeout", str(args.duration * 3))
                shorts.wait()
                longs.wait()
                doc = json.loads(short_out.read_text())["summary"]
                rows.append((mode, rate, doc))
                print(f"{mode:13s} rate {rate:4.1f}/s: TTFT p90 {doc['ttft_ms']['p90']:8.0f} ms, "
                      f"ITL p99 {doc['itl_ms']['p99']:7.0f} ms, goodput {doc['goodput']:.2f} req/s "
                      f"({doc['completed']}/{doc['num_requests']} done)", flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    print(f"\nSLO: TTFT <= {args.slo_ttft_ms:.0f} ms and every ITL gap <= {args.slo_itl_ms:.0f} ms; "
          f"long prompts at {args.long_rate}/s alongside; cores {args.cores}")
    by = {(m, r): d for m, r, d in rows}
    for rate in sorted({r for _, r, _ in rows}):
        c, d = by[("colocated", rate)], by[("disaggregated", rate)]
        ratio = d["goodput"] / c["goodput"] if c["goodput"] else float("inf")
        print(f"rate {rate:4.1f}/s: goodput disaggregated/colocated {ratio:.2f}x, ITL p99 "
              f"{c['itl_ms']['p99']:.0f} -> {d['itl_ms']['p99']:.0f} ms, TTFT p90 "
              f"{c['ttft_ms']['p90']:.0f} -> {d['ttft_ms']['p90']:.0f} ms")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
