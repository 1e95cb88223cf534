"""`python -m pdserve.chaos` (also `pdserve chaos`): start a `pdserve up` cluster, put a
steady streaming load on it, inject a random fault every --fault-interval seconds for
--duration seconds, then stop the load, let the cluster go idle and check it.

Passes (exit 0) when: no request failed (every fault absorbed: migration, restarts, client
retries of a refused connection), no seeded request diverged from its other runs, no worker
holds a KV block once idle, the router's KV index agrees with the workers' caches, every
registered worker answered the idle checks within their bounds (what did not is reported
under "unsettled"), and no process that lived through the whole run grew its RSS by more
than --max-rss-growth. The report (JSON) also has the faults, the router's migration
counters, the per-request longest chunk gap (the seam) and RSS."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from local_cluster.launcher import UpProcess
from local_cluster.run_file import cluster_auth, etcd_credentials
from pdserve.chaos.checks import (
    index_mismatch,
    leaked_blocks,
    router_metric,
    rss_bytes,
    stranded_tier_blocks,
    workers_metric,
)
from pdserve.chaos.faults import KINDS, Fault, Injector
from pdserve.chaos.load import Load

# Test-sized workers (2 layers, fp32) unless --full-model.
SMALL_WORKERS = [
    "--worker-arg=--num-layers=2",
    "--worker-arg=--kv-cache-memory=64MiB",
    "--worker-arg=--dtype=float32",
]


class Cluster(UpProcess):
    """The chaos run's own `pdserve up` (fresh PDSERVE_CACHE: never another up's)."""

    def __init__(self, args: argparse.Namespace, home: Path) -> None:
        flags = [] if args.full_model else SMALL_WORKERS
        super().__init__(
            home,
            "--prefill",
            str(args.prefill),
            "--decode",
            str(args.decode),
            "--num-threads",
            "1",
            "--log-dir",
            str(args.log_dir or home / "logs"),
            *flags,
            f"--router-arg=--stall-timeout={args.stall_timeout}",
            # Faults here are deliberate and frequent: no crash-loop verdict and no
            # growing backoff for them (a crash is forgotten after 10 s), and the
            # router waits for a worker long enough to ride out a restart.
            "--max-restarts",
            "1000",
            "--restart-window",
            "10",
            "--router-arg=--queue-timeout=60",
            *args.up_arg,
        )

    def child_pids(self) -> list[int]:
        return [pid for pids in self.control()["pids"].values() for pid in pids]


def run(args: argparse.Namespace) -> dict:
    kinds = tuple(k for k in args.faults.split(",") if k)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"unknown fault kinds: {sorted(unknown)}")
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as home:
        cluster = Cluster(args, Path(home))
        try:
            return asyncio.run(_drive(args, cluster, kinds))
        finally:
            code = cluster.stop()
            if code != 0:
                print(f"warning: pdserve up exited with {code}", file=sys.stderr)


async def _drive(args, cluster: Cluster, kinds: tuple[str, ...]) -> dict:
    models = json.loads(urllib.request.urlopen(cluster.url + "/v1/models", timeout=5).read())
    model = models["data"][0]["id"]
    load = Load(cluster.url, model, args.concurrency, args.max_tokens, args.cancel_share, args.seed)
    load_task = asyncio.create_task(load.run())
    await asyncio.sleep(3.0)  # warm up before the baseline RSS sample
    rss_start = {pid: rss_bytes(pid) for pid in cluster.child_pids()}
    injector = Injector(cluster.run, kinds, args.stall, args.seed)
    faults: list[Fault] = []
    deadline = time.monotonic() + args.duration
    cluster_error = None
    while time.monotonic() < deadline and not load_task.done():
        try:
            fault = await asyncio.to_thread(injector.inject)
        except OSError as exc:  # the control port is gone: `pdserve up` itself stopped
            cluster_error = f"pdserve up stopped answering: {exc!r}"
            break
        if fault is not None:
            faults.append(fault)
            print(f"[chaos] {fault.kind} {fault.target} (pid {fault.pid})", flush=True)
        await asyncio.sleep(args.fault_interval)
    load.stop()
    stats = await load_task
    print(f"[chaos] load done: {dict(stats.outcomes)}; checking the idle cluster", flush=True)
    if cluster_error is not None:
        return {
            "passed": False,
            "cluster_error": cluster_error,
            "faults": [f.kind for f in faults],
            "requests": dict(stats.outcomes),
            "failures": stats.failures[:20],
        }
    etcd, name = cluster.run["etcd"], cluster.run["cluster"]
    credentials = etcd_credentials(cluster.run)
    auth = cluster_auth(cluster.run)  # the token `up` gave its workers
    leaks = await leaked_blocks(etcd, name, auth, credentials=credentials)
    tiers = await stranded_tier_blocks(etcd, name, auth, credentials=credentials)
    mismatch = await index_mismatch(cluster.url, etcd, name, auth, credentials=credentials)
    unsettled = {**leaks.unsettled, **tiers.unsettled, **mismatch.unsettled}
    # What the KV fabric did: the workers alive at the end, each counted since its start.
    fabric = {
        key: await workers_metric(etcd, name, f"pdserve_worker_{key}_total", credentials, **labels)
        for key, labels in (
            ("kv_offload_demotions", {}),
            ("kv_offload_promotions", {}),
            ("kv_pulls", {"outcome": "pulled"}),
            ("kv_exports", {"outcome": "sent"}),
        )
    }
    # Processes that lived through the whole run (a killed one is a new pid).
    rss_end = {pid: rss_bytes(pid) for pid in cluster.child_pids() if rss_start.get(pid)}
    growths = {
        pid: (end - start) / start
        for pid, end in rss_end.items()
        if end and (start := rss_start[pid])
    }
    growth = max(growths.values(), default=None)
    seams = sorted(stats.seams)
    report = {
        "duration_s": args.duration,
        "faults": [f.kind for f in faults],
        "fault_counts": {k: sum(f.kind == k for f in faults) for k in kinds},
        "requests": dict(stats.outcomes),
        "failures": stats.failures[:20],
        "diverged": [list(k) for k in stats.diverged],
        "router_connection_retries": stats.router_retries,
        # Counters of the router now running (a restart-router fault resets them).
        "migrations_since_router_start": _router_metric_or_none(
            cluster.url, "pdserve_router_migrations_total"
        ),
        "fabric": fabric,
        "leaked_blocks": leaks.value,
        "stranded_tier_blocks": tiers.value,
        "kv_index_mismatch": mismatch.value,
        "unsettled": unsettled,
        "rss_growth_max": growth,
        "rss_processes_lived_through": len(growths),
        "seam_s": {
            "p50": _pct(seams, 0.5),
            "p99": _pct(seams, 0.99),
            "max": seams[-1] if seams else None,
        },
    }
    report["passed"] = (
        not stats.outcomes.get("failed")
        and not stats.diverged
        and not leaks.value
        and not tiers.value
        and mismatch.value == 0
        and not unsettled
        and (growth is None or growth <= args.max_rss_growth)
        and stats.outcomes.get("completed", 0) > 0
    )
    return report


def _router_metric_or_none(router_url: str, name: str) -> float | None:
    try:
        return router_metric(router_url, name)
    except OSError:  # the router did not answer (the checks say so under "unsettled")
        return None


def _pct(values: list[float], q: float) -> float | None:
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def main(args: argparse.Namespace) -> int:
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.report:
        args.report.write_text(text)
    return 0 if report["passed"] else 1
