"""A `pdserve up` cluster as a child process for benchmarks, and the checks around it: the flags
of its command line against the `--help` of the programs they go to (`unknown_flags`), the
workers' /metrics summed (`Cluster.worker_metrics`).
The cluster runs on 127.0.0.1 with free ports and its own PDSERVE_CACHE, and is stopped by its
PID (SIGTERM: `up` drains and stops its children; SIGKILL of its process group after 60 s).

`start_pinned` / `stop_pinned`: a one-decode-worker `up` pinned to host cores (taskset), with
or without one prefill worker, for the split-vs-colocated scripts (split_ttft.py,
handover_bench.py, colocated_vs_disagg.py); `add_pinned_args` / `pinned_worker_flags`: the
command-line arguments those scripts share."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def known_flags(*command: str) -> set[str]:
    """The long options in `pdserve <command> --help`."""
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", *command, "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(re.findall(r"--[a-z0-9][a-z0-9-]*", out))


def unknown_flags(args: list[str], up: set[str], router: set[str], worker: set[str]) -> list[str]:
    """The flags in `pdserve up` arguments that their program does not know: `--router-arg=F`
    is the router's, `--worker-arg=F` (and the per-role ones) the workers', others up's."""
    nested = {
        "--router-arg": router,
        "--worker-arg": worker,
        "--prefill-arg": worker,
        "--decode-arg": worker,
    }
    bad = []
    for arg in args:
        if not arg.startswith("--"):
            continue
        name, _, value = arg.partition("=")
        if name in nested and value.startswith("--"):
            if value.partition("=")[0] not in nested[name]:
                bad.append(arg)
        elif name not in up:
            bad.append(arg)
    return bad


class Cluster:
    """`pdserve up` as a child process (its own session), until `stop`."""

    def __init__(
        self,
        args: list[str],
        work: Path,
        prefill: int = 1,
        decode: int = 2,
        start_timeout_s: float = 600.0,
    ) -> None:
        """Start it and wait for "pdserve is up" (RuntimeError with its output if it exits or
        times out first). `args`: more `pdserve up` arguments; logs go to `work`/logs."""
        self.work = work
        env = {**os.environ, "PDSERVE_CACHE": str(work / "cache")}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve",
                "up",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--prefill",
                str(prefill),
                "--decode",
                str(decode),
                "--log-dir",
                str(work / "logs"),
                *args,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.url = ""
        self.output: list[str] = []
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.output.append(line)
                if line.startswith("pdserve is up: "):
                    self.url = line.split()[3]
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + start_timeout_s
        while not ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"pdserve up {' '.join(args)} did not start; its output:\n"
                    + "".join(self.output[-30:])
                    + f"\nlogs: {work / 'logs'}"
                )

    def worker_metrics(self) -> dict[str, float]:
        """Summed over the workers' /metrics (addresses from their READY lines)."""
        import httpx

        names = {
            "prefix_cache_queries": "vllm:prefix_cache_queries_total",
            "prefix_cache_hits": "vllm:prefix_cache_hits_total",
            "tier_hit_tokens": "pdserve_worker_kv_offload_hits_tokens_total",
            "pulled_blocks": "pdserve_worker_kv_pull_blocks_total",
            "pulls": "pdserve_worker_kv_pulls_total",
        }  # by outcome, below
        totals = dict.fromkeys(names, 0.0)
        for log in (self.work / "logs").glob("*.log"):
            for address in re.findall(
                r"^READY \S+ \S+ grpc=\S+ metrics=(\S+)", log.read_text(), re.M
            )[-1:]:
                text = httpx.get(f"http://{address}/metrics", timeout=10).text
                for key, metric in names.items():
                    for m in re.finditer(
                        rf"^{re.escape(metric)}(?:{{([^}}]*)}})? (\S+)$", text, re.M
                    ):
                        totals[key] += float(m.group(2))
                        outcome = re.search(r'outcome="(\w+)"', m.group(1) or "")
                        if outcome:
                            sub = f"{key}_{outcome.group(1)}"
                            totals[sub] = totals.get(sub, 0.0) + float(m.group(2))
        return totals

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def add_pinned_args(parser: argparse.ArgumentParser) -> None:
    """`--cores` and `--num-layers`, as every script that starts `start_pinned` clusters has."""
    parser.add_argument("--cores", default="0,1")
    parser.add_argument("--num-layers", type=int, default=None, help="truncate (smoke runs)")


def pinned_worker_flags(args: argparse.Namespace, kv_cache_memory: str) -> list[str]:
    """The workers' flags from `add_pinned_args`' arguments: the KV cache size, and
    `--num-layers` when given."""
    flags = [f"--kv-cache-memory={kv_cache_memory}"]
    if args.num_layers:
        flags.append(f"--num-layers={args.num_layers}")
    return flags


def start_pinned(
    name: str,
    cores: str,
    work: Path,
    *,
    split: bool,
    up_args: list[str],
    num_threads: int = 1,
    env: dict[str, str] | None = None,
    start_timeout_s: float = 600.0,
) -> tuple[subprocess.Popen, str]:
    """`pdserve up --port 0 --prefill 1|0 --decode 1` (one prefill worker when `split`), pinned
    to `cores` (`taskset -c`), workers on `num_threads` threads each, then `up_args`; logs in
    `work`/logs-`name`, PDSERVE_CACHE `work`/cache-`name` (`env` adds to the environment).
    Returns (process, router URL) once it printed "pdserve is up"; if it did not within
    `start_timeout_s`, it is stopped and RuntimeError raised."""
    cmd = [
        "taskset",
        "-c",
        cores,
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--port",
        "0",
        "--prefill",
        "1" if split else "0",
        "--decode",
        "1",
        "--num-threads",
        str(num_threads),
        "--log-dir",
        str(work / f"logs-{name}"),
        *up_args,
    ]
    env = {**os.environ, "PDSERVE_CACHE": str(work / f"cache-{name}"), **(env or {})}
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    url: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("pdserve is up: "):
                url.append(line.split()[3])
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(start_timeout_s):
        stop_pinned(proc)
        raise RuntimeError(f"pdserve up ({name}) did not start; logs in {work}")
    return proc, url[0]


def stop_pinned(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group of a `start_pinned` cluster; SIGKILL after 60 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def bench_completions(url: str, out: Path, *flags: str, env: dict[str, str] | None = None) -> dict:
    """One `pdserve bench` run of /v1/completions against `url` with `flags` (its console
    report silenced, its JSON to `out`); returns the report's summary."""
    subprocess.run(
        [
            sys.executable, "-m", "pdserve.bench", "--url", url, "--endpoint", "completions",
            "--no-progress", "--out", str(out), *flags,
        ],
        env=env, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return json.loads(out.read_text())["summary"]
