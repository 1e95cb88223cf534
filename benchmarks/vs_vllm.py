"""pdserve vs vLLM-CPU on this machine, same model, same workload, both pinned to the same
cores, ratios printed (docs: benchmarks/vs_vllm.md).

  python benchmarks/vs_vllm.py offline [--vllm-python V/bin/python] [--num-prompts 16]
  python benchmarks/vs_vllm.py serve   [--vllm-python V/bin/python] [--rates 0.5,1,2]
                                       [--repeats 2] [--planner]

offline: N random-token prompts of 128-512 tokens -> 128 output tokens each (ignore_eos), the
  offline API of each (`LLM.generate`), one run each side, alone, each at its default dtype unless
  --dtype; reports output tokens/s, engine start-up (with one short warm-up request) and the ratio.
serve:   `pdserve up` at its defaults (on a host of at most 2 cores: one colocated decode
  worker; with --planner, the planner on; `--variant NAME=UP_FLAGS` adds clusters, e.g.
  'split=--prefill 1 --decode 1 --num-threads 1') and `vllm serve`, all up together, the same
  `pdserve bench` load against each (random 256-token prompts -> 64 tokens, Poisson, ignore_eos),
  per rate --repeats rounds, the sides taking turns in an order reversed every other round: TTFT,
  ITL, req/s, goodput (TTFT <= 2 s, every gap <= 250 ms); medians over rounds, ratios to vLLM.

Without --vllm-python vLLM's side does not run (pdserve's numbers, no ratios)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import NamedTuple

import httpx

_OFFLINE = textwrap.dedent("""
    import json, sys, time
    side, model, dtype, prompts_file, max_tokens = sys.argv[1:6]
    prompts = json.load(open(prompts_file))
    t0 = time.perf_counter()
    if side == "pdserve":
        from engine import LLM, SamplingParams
        llm = LLM(model, dtype=dtype, kv_cache_memory=3 << 30)
        inputs = prompts
    else:
        from vllm import LLM, SamplingParams
        llm = LLM(model, dtype=dtype, max_model_len=2048)
        inputs = [{"prompt_token_ids": p} for p in prompts]
    # Warm-up (one short request; vLLM does its own inside LLM()): counted as start-up.
    llm.generate(inputs[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"start_s": start_s, "gen_s": gen_s, "tokens": tokens}
    print("RESULT " + json.dumps(result), flush=True)
""")


def _prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _model_dir() -> str:
    """The bundled model, prepared as an HF directory (what `vllm serve` / vLLM's LLM load)."""
    return subprocess.run(
        [sys.executable, "-m", "pdserve", "prepare-model"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def _pinned(cores: str, argv: list[str]) -> list[str]:
    return ["taskset", "-c", cores, *argv] if cores else argv


def _offline_side(side: str, python: str, args, prompts_file: Path, model: str) -> dict:
    dtype = args.dtype or ("auto" if side == "pdserve" else args.vllm_dtype)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(
        _pinned(
            args.cores,
            [python, "-c", _OFFLINE, side, model, dtype, str(prompts_file), str(args.output_len)],
        ),
        capture_output=True,
        text=True,
        env=env,
        timeout=args.timeout,
        cwd=Path(__file__).parents[1],
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[7:]), "dtype": dtype}
    raise RuntimeError(f"{side} offline run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def offline(args) -> None:
    model = _model_dir()
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(_prompts(args.num_prompts, 128, 512)))
        sides = [("pdserve", sys.executable)] + (
            [("vllm", args.vllm_python)] if args.vllm_python else []
        )
        results = {
            side: _offline_side(side, python, args, prompts_file, model) for side, python in sides
        }
    print(
        f"\n== offline: {args.num_prompts} prompts of 128-512 random tokens -> {args.output_len} "
        f"tokens (cores {args.cores or 'all'}) =="
    )
    for side, r in results.items():
        print(
            f"{side:8s} dtype {r['dtype']:8s} start {r['start_s']:6.1f} s, generate "
            f"{r['gen_s']:7.1f} s, "
            f"{r['tokens'] / r['gen_s']:7.1f} output tok/s"
        )
    if "vllm" in results:
        p, v = results["pdserve"], results["vllm"]
        print(
            f"ratio pdserve/vLLM: {(p['tokens'] / p['gen_s']) / (v['tokens'] / v['gen_s']):.2f}x "
            "output tok/s, "
            f"start-up {p['start_s']:.1f} s vs {v['start_s']:.1f} s"
        )


class _Server:
    """A server process in its own session (stopped with its whole group) and its base URL."""

    def __init__(self, argv: list[str], env: dict, log: Path) -> None:
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.url = ""

    def wait_ready(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited (rc {self.proc.returncode}); log: {self.log.name}"
                )
            try:  # ready = serves a completion (a router answers /v1/models before its workers)
                if (
                    httpx.post(
                        f"{url}/v1/completions",
                        timeout=30,
                        json={"model": "smollm2", "prompt": "Hello", "max_tokens": 1},
                    ).status_code
                    == 200
                ):
                    self.url = url
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"server not ready in {timeout:.0f} s; log: {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_pdserve(
    args, model: str, work: Path, name: str = "pdserve", up_flags: tuple[str, ...] = ()
) -> _Server:
    """`pdserve up` with `up_flags` (default: its own defaults, plus --num-threads
    --pdserve-threads when given)."""
    port = _free_port()
    pools = list(up_flags) or (
        ["--num-threads", str(args.pdserve_threads)] if args.pdserve_threads else []
    )
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--port",
        str(port),
        *pools,
        "--model",
        model,
        "--log-dir",
        str(work / f"logs-{name}"),
        "--router-arg=--served-model-name=smollm2",
        "--worker-arg=--kv-cache-memory=1GiB",
    ]
    if args.planner:
        argv.append("--planner")
    argv += [f"--worker-arg={flag}" for flag in args.worker_arg]
    argv += [f"--prefill-arg={flag}" for flag in args.prefill_arg]
    server = _Server(
        _pinned(args.cores, argv),
        {**os.environ, "PDSERVE_CACHE": str(work / "cache")},
        work / f"{name}.log",
    )
    server.wait_ready(f"http://127.0.0.1:{port}", 300)
    return server


def _start_vllm(args, model: str, work: Path) -> _Server:
    port = _free_port()
    argv = [
        str(Path(args.vllm_python).parent / "vllm"),
        "serve",
        model,
        "--dtype",
        args.vllm_dtype,
        "--max-model-len",
        "2048",
        "--served-model-name",
        "smollm2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"}
    server = _Server(_pinned(args.cores, argv), env, work / "vllm.log")
    server.wait_ready(f"http://127.0.0.1:{port}", 600)
    return server


def _load(url: str, rate: float, args, out: Path, seed: int, num_prompts: int = 0) -> dict:
    """One `pdserve bench` run against `url`, its JSON to `out`; returns its summary."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.bench",
            "--url",
            url,
            "--endpoint",
            "completions",
            "--model",
            "smollm2",
            "--no-progress",
            "--num-requests",
            str(num_prompts or args.num_prompts),
            "--input-len",
            "256",
            "--output-len",
            "64",
            "--ignore-eos",
            "--tokenizer",
            "default",
            "--request-rate",
            str(rate),
            "--seed",
            str(seed),
            "--slo-ttft-ms",
            "2000",
            "--slo-itl-ms",
            "250",
            "--timeout",
            str(args.timeout),
            "--out",
            str(out),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        cwd=Path(__file__).parents[1],
    )
    return json.loads(out.read_text())["summary"]


class Metrics(NamedTuple):
    """One run's figures, a median over rounds, or (`ratio`) one side's over another's."""

    ttft_p50: float  # ms, as the other three latencies
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    req_s: float  # completed requests / s
    goodput: float  # requests / s within the SLO

    @classmethod
    def of(cls, summary: dict) -> Metrics:
        """From a `pdserve bench` summary."""
        t, i = summary["ttft_ms"], summary["itl_ms"]
        return cls(
            t["p50"],
            t["p99"],
            i["p50"],
            i["p99"],
            summary["request_throughput"],
            summary["goodput"],
        )

    def line(self) -> str:
        return (
            f"TTFT p50/p99 {self.ttft_p50:6.0f} / {self.ttft_p99:6.0f} ms, ITL p50/p99 "
            f"{self.itl_p50:5.0f} / "
            f"{self.itl_p99:5.0f} ms, {self.req_s:.2f} req/s, goodput {self.goodput:.2f} req/s"
        )


class Turn(NamedTuple):
    """One served run: `side` under the load at `rate` with `seed`, in round `round` (from 0)."""

    rate: float
    round: int
    side: str
    seed: int


def schedule(sides: list[str], rates: list[float], repeats: int) -> list[Turn]:
    """Every served run, in order: per rate, `repeats` rounds; in each, every side once, the order
    reversed every other round (A B, B A, A B, ...), so the sides share each stretch of time. The
    seed is distinct per (rate, round), so no run re-sends prompts an earlier run sent to the same
    server (no prefix-cache hits), and the same on every side; 0 is the warm-up's."""
    return [
        Turn(rate, r, side, 1 + i * repeats + r)
        for i, rate in enumerate(rates)
        for r in range(repeats)
        for side in (sides if r % 2 == 0 else sides[::-1])
    ]


def median(rounds: list[Metrics]) -> Metrics:
    return Metrics(*map(statistics.median, zip(*rounds)))


def ratio(a: Metrics, b: Metrics) -> Metrics:
    """a / b field by field (inf where b's is 0)."""
    return Metrics(*(x / y if y else float("inf") for x, y in zip(a, b)))


def summary(
    results: dict[tuple[str, float], list[Metrics]], sides: list[str], rates: list[float]
) -> list[str]:
    """Per rate and side, the median over its rounds; with a "vllm" side, each other side's ratios
    of those medians to vLLM's and, to show the spread, its per-round TTFT p99 and ITL p99
    ratios."""
    lines = [
        f"{side:14s} rate {rate:4.1f}/s: {median(results[side, rate]).line()}"
        for rate in rates
        for side in sides
    ]
    if "vllm" not in sides:
        return lines
    lines.append("ratios to vLLM (of the medians; per round: TTFT p99, ITL p99):")
    for rate in rates:
        v = results["vllm", rate]
        for side in (s for s in sides if s != "vllm"):
            r, rounds = (
                ratio(median(results[side, rate]), median(v)),
                list(map(ratio, results[side, rate], v)),
            )
            lines.append(
                f"{side:14s} rate {rate:4.1f}/s: TTFT p50 {r.ttft_p50:.2f}x p99 {r.ttft_p99:.2f}x, "
                f"ITL p50 {r.itl_p50:.2f}x p99 {r.itl_p99:.2f}x, req/s {r.req_s:.2f}x, "
                f"goodput {r.goodput:.2f}x"
                f"; per round TTFT p99 {' '.join(f'{x.ttft_p99:.2f}x' for x in rounds)}, "
                f"ITL p99 {' '.join(f'{x.itl_p99:.2f}x' for x in rounds)}"
            )
    return lines


def serve(args) -> None:
    model = _model_dir()
    rates = [float(r) for r in args.rates.split(",")]
    work = Path(tempfile.mkdtemp(prefix="pdserve-vs-vllm-"))
    starters = {"pdserve": _start_pdserve}
    for variant in args.variant:  # NAME=UP FLAGS: more pdserve clusters, same load
        name, _, flags = variant.partition("=")
        starters[name] = functools.partial(
            _start_pdserve, name=name, up_flags=tuple(shlex.split(flags))
        )
    if args.vllm_python:
        starters["vllm"] = _start_vllm
    results: dict[tuple[str, float], list[Metrics]] = {}
    with contextlib.ExitStack() as servers:  # every server stopped, whatever fails
        urls = {}
        for side, start in starters.items():
            server = start(args, model, work)
            servers.callback(server.stop)
            urls[side] = server.url
            _load(
                server.url, 2.0, args, work / f"{side}-warmup.json", seed=0, num_prompts=8
            )  # not reported
        for t in schedule(list(starters), rates, args.repeats):
            doc = _load(
                urls[t.side], t.rate, args, work / f"{t.side}-{t.rate}-r{t.round + 1}.json", t.seed
            )
            m = Metrics.of(doc)
            results.setdefault((t.side, t.rate), []).append(m)
            print(
                f"{t.side:14s} rate {t.rate:4.1f}/s round {t.round + 1}: {m.line()}, "
                f"{doc['completed']}/{doc['num_requests']} done",
                flush=True,
            )
    print(
        f"\n== served: random 256 -> 64 tokens, {args.num_prompts} requests per run, "
        f"SLO TTFT <= 2 s and every gap <= 250 ms (cores {args.cores or 'all'}; "
        f"pdserve: `pdserve up`'s defaults{' + planner' if args.planner else ''}); "
        f"median of {args.repeats} rounds per rate, sides alternating =="
    )
    print("\n".join(summary(results, list(starters), rates)))
    print(f"raw results: {work}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    for name in ("offline", "serve"):
        p = sub.add_parser(name)
        p.add_argument(
            "--vllm-python", default="", help="python of a venv with vllm-cpu (see vs_vllm.md)"
        )
        p.add_argument(
            "--vllm-dtype",
            default="auto",
            help="vLLM's dtype (float32 on CPUs without AVX-512 BF16: bf16 is emulated)",
        )
        p.add_argument(
            "--cores", default="0,1", help="taskset cores for both sides ('' = no pinning)"
        )
        p.add_argument("--timeout", type=float, default=1800)
    off, srv = sub.choices["offline"], sub.choices["serve"]
    off.add_argument("--num-prompts", type=int, default=16)
    off.add_argument("--output-len", type=int, default=128)
    off.add_argument("--threads", type=int, default=2)
    off.add_argument("--dtype", default="", help="both sides' dtype (default: each side's default)")
    srv.add_argument("--num-prompts", type=int, default=48)
    srv.add_argument("--rates", default="0.5,1,2")
    srv.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="rounds per rate; the sides take turns, the order reversed every other round",
    )
    srv.add_argument("--planner", action="store_true", help="pdserve up --planner")
    srv.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=UP_FLAGS",
        help="also measure `pdserve up UP_FLAGS` under NAME, e.g. "
        "'split=--prefill 1 --decode 1 --num-threads 1' (repeatable)",
    )
    srv.add_argument(
        "--pdserve-threads",
        type=int,
        default=0,
        help="torch threads per pdserve worker (0: `pdserve up`'s default, cores / workers)",
    )
    srv.add_argument(
        "--worker-arg", action="append", default=[], help="extra flag for every pdserve worker"
    )
    srv.add_argument(
        "--prefill-arg",
        action="append",
        default=[],
        help="extra flag for pdserve's prefill workers",
    )
    args = parser.parse_args()
    if args.mode == "serve" and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.mode == "serve":  # sides are kept by name: a variant must not replace another side
        names = ["pdserve", "vllm"] + [v.partition("=")[0] for v in args.variant]
        if len(set(names)) < len(names):
            parser.error(
                f"--variant names must differ from each other and from pdserve/vllm: {names[2:]}"
            )
    offline(args) if args.mode == "offline" else serve(args)


if __name__ == "__main__":
    main()
