"""The GPU check: every measurement that needs CUDA, in one command (tools/gpu/gpu_check.sh).

Steps, each printed as it finishes and collected into OUT/gpu_check.json (written after every
step; a failing step is recorded and the others still run):
1. pytest, the `gpu` tests: the kernels against their torch references at realistic sizes,
   the engine's greedy tokens with the Triton backend == the torch backend == transformers
   (fp32, full depth), the KV pool sized from gpu_memory_utilization, VRAM-to-VRAM NIXL.
2. Device-to-device copy bandwidth (a torch copy of 1 GiB): the practical memory roof.
3. Decode attention (SmolLM2-135M shapes, one layer): bytes of KV read per second with the
   automatic split-KV choice, fixed splits and launch-option variants, as a fraction of the
   copy bandwidth, timed as launched and replayed from a CUDA graph (the GPU's time alone,
   as decode steps run); one prefill chunk's TFLOP/s for orientation.
4. Engine offline throughput (128 prompts x 128 greedy tokens, then 8 x 128) with the Triton
   backend and CUDA graphs for decode steps (the default), the Triton backend eagerly
   (enforce_eager) and the torch backend; the KV pool `gpu_memory_utilization` gave each, the
   sizes captured, and how far the variants' bf16 greedy tokens agree.
5. NIXL/UCX KV block transfer between two processes on the one GPU, VRAM to VRAM
   (benchmarks/kv_transfer.py --device cuda), against the device copy of step 2.
6. Disaggregated vs local TTFT with one prefill and one decode worker on the same GPU, etcd and
   gRPC on loopback (benchmarks/pd_bench.py --device cuda).
7. Tensor parallelism, on a machine with 2 or more GPUs (skipped, saying so, with one): the
   same greedy batch at tensor_parallel_size 1 and 2, tokens/s and token agreement
   (tools/gpu/gpu_measure.py `tp_parity`; docs/parallelism.md).

The model: --model, else a random-weight copy of the default model's shape written from
.gpu_bundle/model (tools/gpu/gpu_bundle.py: the GPU machine has no network and cannot carry
the real weights), else the bundled default model.

--dry-run runs the same code on CPU under the Triton interpreter with tiny shapes (a test runs
it), so the script is known to work before it meets a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUNDLE_MODEL = REPO / ".gpu_bundle" / "model"
GPU_TESTS = [
    "tests/kernels",
    "tests/engine/test_gpu_engine.py",
    "tests/kvtransfer/test_kv_nixl_local.py",
]
# Seconds a step needs at least; a step is skipped when less of the budget is left.
NEEDS_S = {"engine": 60, "transfer": 45, "pd": 90, "tp": 60}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU + Triton interpreter, tiny shapes (checks the script itself)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model for steps 1, 4, 6 (default: random weights from .gpu_bundle/model, "
        "else the bundled model)",
    )
    p.add_argument(
        "--random-from",
        type=Path,
        default=None,
        help="write random weights with this directory's config and tokenizer and use them",
    )
    for step in ("pytest", "engine", "transfer", "pd", "tp"):
        p.add_argument(f"--skip-{step}", action="store_true", help=f"skip the {step} step")
    p.add_argument(
        "--budget-s",
        type=float,
        default=420,
        help="wall-clock budget: later steps are skipped (and pytest's timeout shrinks) to fit",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=REPO / "benchmarks" / "results" / "gpu",
        help="folder for gpu_check.json and the steps' logs",
    )
    return p.parse_args(argv)


def resolve_model(args: argparse.Namespace) -> Path:
    """--model; else random weights (from --random-from or .gpu_bundle/model); else the bundled
    model."""
    if args.model:
        return Path(args.model) if args.model != "default" else _default_model()
    source = args.random_from or (
        BUNDLE_MODEL if (BUNDLE_MODEL / "config.json").is_file() else None
    )
    if source is None:
        return _default_model()
    from engine.models.random_weights import write_random_model

    out = Path(os.environ.get("TMPDIR", "/tmp")) / "pdserve-gpu-check-model"
    return write_random_model(source, out, seed=0, num_layers=2 if args.dry_run else None)


def _default_model() -> Path:
    from engine.models.prepare import default_model_dir

    return default_model_dir()


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> dict:
    """Run `cmd` from the repo root with its output in `log`; the tail comes back."""
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            code = subprocess.run(
                cmd,
                cwd=REPO,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                env={**os.environ, **(env or {})},
            ).returncode
        except subprocess.TimeoutExpired:
            code = f"timeout after {timeout:.0f} s"
    lines = log.read_text(errors="replace").strip().splitlines()
    return {
        "command": " ".join(cmd),
        "returncode": code,
        "summary": lines[-1] if lines else "",
        "seconds": round(time.perf_counter() - start, 1),
        "output_tail": "\n".join(lines[-40:]),
    }


def run_pytest(out: Path, model: Path, timeout: float, workers: int = 0) -> dict:
    """`workers` > 0: pytest-xdist processes, one test file each (Triton's compiles run on
    the CPU; the engine tests of one file share a module fixture and the GPU's memory)."""
    cmd = [sys.executable, "-m", "pytest", *GPU_TESTS, "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    if workers:
        cmd += ["-n", str(workers), "--dist", "loadfile"]
    # returncode 5 would mean nothing was selected; on CPU every gpu test is skipped (0).
    return run_logged(cmd, out / "pytest.log", timeout, {"PDSERVE_GPU_MODEL": str(model)})


def kv_transfer(out: Path, device, copy_gbps: float, dry_run: bool, timeout: float) -> dict:
    """NIXL between two processes (VRAM pools on GPU) vs the device copy (bytes once)."""
    with tempfile.TemporaryDirectory(prefix="kv-transfer-") as scratch:  # the rows go in the report
        result_file = Path(scratch) / "kv_transfer.json"
        cmd = [
            sys.executable,
            "benchmarks/kv_transfer.py",
            "--device",
            device.type,
            "--json",
            str(result_file),
        ]
        if dry_run:
            cmd += ["--quick", "--reps", "2"]
        run = run_logged(cmd, out / "kv_transfer.log", timeout)
        if run["returncode"] != 0:
            raise RuntimeError(f"kv_transfer failed ({run['returncode']}):\n{run['output_tail']}")
        rows = json.loads(result_file.read_text())["rows"]
    copy_once = copy_gbps / 2  # step 2 counts bytes read + written; a transfer moves them once
    summary = [
        {
            "block_tokens": r["block_tokens"],
            "total_mib": r["total_mib"],
            "nixl_gbps": round(r["nixl_gbps_best"], 2),
            "scattered_copy_gbps": round(max(r["memcpy_1t_gbps"], r["memcpy_all_gbps"]), 2),
            "fraction_of_device_copy": round(r["nixl_gbps_best"] / copy_once, 3),
        }
        for r in rows
    ]
    for r in summary:
        print(
            f"  {r['block_tokens']:4d}-token blocks {r['total_mib']:4d} MiB: NIXL "
            f"{r['nixl_gbps']:8.2f} GB/s"
            f" = {r['fraction_of_device_copy']:6.1%} of the device copy ({copy_once:.0f} GB/s)",
            flush=True,
        )
    big = [r["fraction_of_device_copy"] for r in summary if r["total_mib"] >= 64]
    return {
        "rows": summary,
        "device_copy_gbps_once": round(copy_once, 1),
        "worst_fraction_at_64mib_plus": min(big) if big else None,
        "log": run["summary"],
    }


def pd_ttft(out: Path, model: Path, device, dry_run: bool, timeout: float) -> dict:
    """pd_bench at each prefill chunk size (on the GPU the engine's default, 2048, then 512):
    `rows` are the first's, `by_chunk` all of them; the first's worker logs in pd_logs/<chunk>/
    (the others' are not kept: at most eight files come back)."""
    by_chunk: dict[int, list] = {}
    deadline = time.monotonic() + timeout
    for chunk in (512,) if dry_run else (2048, 512):
        with tempfile.TemporaryDirectory(prefix="pd-bench-") as scratch:
            logs = out / "pd_logs" / str(chunk) if not by_chunk else Path(scratch)
            result_file = Path(scratch) / "pd_bench.json"
            cmd = [
                sys.executable,
                "benchmarks/pd_bench.py",
                "--device",
                device.type,
                "--model",
                str(model),
                "--json",
                str(result_file),
                "--log-dir",
                str(logs),
                "--max-num-batched-tokens",
                str(chunk),
            ]
            if dry_run:
                cmd += ["--lengths", "64", "--repeats", "1", "--kv-cache-memory", "64MiB"]
            run = run_logged(
                cmd, out / f"pd_bench_{chunk}.log", max(30.0, deadline - time.monotonic())
            )
            if run["returncode"] != 0:
                raise RuntimeError(f"pd_bench failed ({run['returncode']}):\n{run['output_tail']}")
            rows = json.loads(result_file.read_text())["rows"]
        print(f"  chunks of {chunk} tokens:", flush=True)
        print("\n".join("  " + line for line in run["output_tail"].splitlines()[-6:]), flush=True)
        by_chunk[chunk] = [{"chunk_tokens": chunk, **row} for row in rows]
    return {"rows": next(iter(by_chunk.values())), "by_chunk": by_chunk}


def summary(report: dict) -> str:
    """The targets' lines, for the end of the output (which comes back even when files do not).
    A step that failed or was skipped shows its record instead of numbers."""

    def section(key: str) -> dict:
        value = report.get(key)
        return value if isinstance(value, dict) else {}

    lines = [
        f"summary ({report.get('device')}, torch {report.get('torch')}, triton "
        f"{report.get('triton')}):",
        f"- gpu tests: {section('pytest').get('summary', report.get('pytest'))}",
    ]
    decode = report.get("decode") if isinstance(report.get("decode"), list) else []
    for r in decode:
        if r["variant"] == decode[0]["variant"]:  # "auto": what the engine runs
            replayed = r.get("replayed_fraction_of_copy")
            lines.append(
                f"- decode attention {r['batch']} x {r['context']}: {r['kv_gbps']} GB/s = "
                f"{r['fraction_of_copy']:.0%} of the copy's {report.get('copy_gbps')} GB/s"
                + ("" if replayed is None else f", {replayed:.0%} replayed from a CUDA graph")
                + " (target >= 70% at 64 x 2048)"
            )
    if not decode:
        lines.append(f"- decode attention: {report.get('decode')}")
    engine = section("engine")
    if "speedup" in engine:
        lines.append(
            f"- engine: triton {engine['triton']['tokens_per_s']} tok/s, torch "
            f"{engine['torch']['tokens_per_s']} tok/s ({engine['speedup']}x); KV pool "
            f"{engine['triton']['kv_pool']}; bf16 greedy agreement {engine['greedy_agreement']}"
        )
        lines.append(
            f"- CUDA graphs {engine['triton']['cuda_graphs']}: vs eager {engine['graph_speedup']} "
            f"(small batch {engine['triton']['small_batch_tokens_per_s']} vs "
            f"{engine['triton_eager']['small_batch_tokens_per_s']} tok/s); agreement "
            f"{engine['graph_vs_eager_agreement']}"
        )
    else:
        lines.append(f"- engine: {report.get('engine')}")
    worst = section("transfer").get("worst_fraction_at_64mib_plus")
    lines.append(
        f"- NIXL transfer: worst {worst:.0%} of the device copy at >= 64 MiB (target >= 80%)"
        if isinstance(worst, float)
        else f"- NIXL transfer: {report.get('transfer')}"
    )
    rows = [
        row for chunk_rows in (section("pd").get("by_chunk") or {}).values() for row in chunk_rows
    ]
    for row in rows:
        lines.append(
            f"- TTFT {row['prompt_tokens']} tokens (chunks of {row['chunk_tokens']}): local "
            f"{row['local_ttft_ms']} ms, disaggregated "
            f"{row['disagg_ttft_ms']} ms, added {row['added_fraction']:.1%} (target <= 15% at 2048)"
        )
    if not rows:
        lines.append(f"- TTFT: {report.get('pd')}")
    tp = section("tp")
    if "tp2_over_tp1" in tp:
        lines.append(
            f"- tensor parallelism: TP=2 {tp['tp2']['tokens_per_s']} tok/s vs TP=1 "
            f"{tp['tp1']['tokens_per_s']} tok/s ({tp['tp2_over_tp1']}x); greedy agreement "
            f"{tp['greedy_agreement']}"
        )
    else:
        lines.append(f"- tensor parallelism: {report.get('tp')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton/kernels are imported
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    sys.path.insert(0, str(REPO))
    import gpu_measure as gm  # beside this file (sys.path[0] when run as a script)
    import torch

    if args.dry_run:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device visible (use --dry-run to check the script on CPU)",
            file=sys.stderr,
        )
        return 2
    else:
        device = torch.device("cuda")
    dtype = (
        torch.bfloat16 if device.type == "cpu" or torch.cuda.is_bf16_supported() else torch.float16
    )
    import triton

    report: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype),
        "python": sys.version.split()[0],
    }
    print(
        f"gpu_check on {report['device']}  torch {torch.__version__}  triton {triton.__version__}",
        flush=True,
    )
    deadline = time.monotonic() + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    failed = False

    def step(key: str, fn, needs_s: float = 0) -> None:
        """Run one step into report[key]; an error is recorded, not fatal; save after each."""
        nonlocal failed
        left = deadline - time.monotonic()
        if needs_s and left < needs_s:
            report[key] = {"skipped": f"time budget: {left:.0f} s left, needs {needs_s:.0f}"}
        else:
            start = time.perf_counter()
            try:
                report[key] = fn()
            except Exception as exc:  # keep the other steps' numbers
                traceback.print_exc()
                report[key] = {"error": f"{type(exc).__name__}: {exc}"}
                failed = True
            report.setdefault("seconds", {})[key] = round(time.perf_counter() - start, 1)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))

    model = resolve_model(args)
    report["model"] = str(model)
    print(f"model: {model}", flush=True)

    print("[1/7] pytest -m gpu", flush=True)
    if args.skip_pytest:
        report["pytest"] = {"skipped": "--skip-pytest"}
    else:
        timeout = (
            120 if args.dry_run else max(90, min(240, deadline - time.monotonic() - 180))
        )  # ~55-67 s on an H200
        workers = 0 if args.dry_run or importlib.util.find_spec("xdist") is None else 4
        step("pytest", lambda: run_pytest(args.out, model, timeout, workers))
        res = report["pytest"]
        print(
            f"  rc={res.get('returncode')} {res.get('summary', '')} ({res.get('seconds')} s)",
            flush=True,
        )
        if res.get("returncode") not in (0, 5):
            failed = True
            print(res.get("output_tail", ""), flush=True)

    timer = gm.Timer(device)
    print("[2/7] device-to-device copy bandwidth", flush=True)
    step("copy_gbps", lambda: round(gm.copy_bandwidth(device, timer, args.dry_run), 1))
    copy_gbps = report["copy_gbps"] if isinstance(report["copy_gbps"], float) else float("nan")
    print(f"  copy: {copy_gbps:.1f} GB/s (read + write)", flush=True)

    print(f"[3/7] paged attention, SmolLM2-135M shapes ({dtype})", flush=True)
    step(
        "decode",
        lambda: [
            asdict(r) for r in gm.decode_bandwidth(device, dtype, timer, copy_gbps, args.dry_run)
        ],
    )
    step("prefill", lambda: gm.prefill_tflops(device, dtype, timer, args.dry_run))

    def later(key: str, n: int, title: str, fn) -> None:
        print(f"[{n}/7] {title}", flush=True)
        if getattr(args, f"skip_{key}"):
            report[key] = {"skipped": f"--skip-{key}"}
        else:
            step(key, fn, NEEDS_S[key])
        if "error" not in report[key] and key == "engine":
            print(f"  agreement: {report[key].get('greedy_agreement')}", flush=True)

    def remaining() -> float:
        return max(30.0, deadline - time.monotonic())

    later(
        "engine",
        4,
        "engine offline throughput, triton vs torch attention",
        lambda: gm.engine_throughput(model, device, args.dry_run),
    )
    later(
        "transfer",
        5,
        "NIXL KV transfer between two processes",
        lambda: kv_transfer(args.out, device, copy_gbps, args.dry_run, remaining()),
    )
    later(
        "pd",
        6,
        "disaggregated vs local TTFT (1 prefill + 1 decode worker)",
        lambda: pd_ttft(args.out, model, device, args.dry_run, remaining()),
    )
    later(
        "tp",
        7,
        "tensor parallelism: tensor_parallel_size 2 vs 1",
        lambda: gm.tp_parity(model, device, args.dry_run),
    )
    print(summary(report), flush=True)
    print(f"report: {args.out / 'gpu_check.json'}  {'FAILED' if failed else 'OK'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
