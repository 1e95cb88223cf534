"""KV transfer throughput between two emulated hosts (network namespaces + veth, UCX TCP),
against the same transfer on one host, in one run. Needs root (see tests/netns/netns_util).

    python benchmarks/kv_netns.py            # 64 MiB requests, 5 runs per link
    python benchmarks/kv_netns.py --quick    # 16 MiB, 3 runs

Two kv_peer processes (tests/kvtransfer/kv_peer.py: 96 KiB fp32 blocks, plain 4 KiB-page
pools) exchange a request of scattered blocks in 8 batches. Time runs in this process from
the first `send` to the receiver's COMPLETE (each command is a pipe round trip, ~0.1 ms).
Links, all in the same run:
  same-host CMA    both peers in one namespace, UCX default transports on lo (CMA copies)
  same-host TCP    both peers in one namespace, UCX_TLS=tcp on lo
  veth TCP         P and D namespaces, UCX_TLS=tcp on the veth
  veth TCP loss 1% the same, 1% of packets dropped each way (nftables)
  veth netem       the same under `netem delay 20ms loss 1%` (only with sch_netem)
Results are printed and written to benchmarks/results/kv_netns.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "netns"), str(ROOT / "tests" / "kvtransfer")]

from netns_util import (  # noqa: E402
    Host,
    NetnsChild,
    netem,
    netem_unavailable,
    packet_loss,
    skip_reason,
    two_hosts,
)

MIB = 1 << 20
BLOCK_BYTES = 4 * 4 * 2 * 16 * 3 * 64  # kv_peer.SHAPE in fp32
RESULTS = ROOT / "benchmarks" / "results" / "kv_netns.json"


def _peer(host: Host, name: str, blocks: int, env: dict[str, str], logs: Path) -> NetnsChild:
    return NetnsChild(
        host, "netns_kv:serve_peer", name, blocks, 1, 30.0, env=env, log_path=logs / f"{name}.log"
    )


def _measure(sender: NetnsChild, receiver: NetnsChild, n: int, runs: int, tag: str) -> dict:
    import torch

    peer = sender.call("add_peer", receiver.metadata)
    g = torch.Generator().manual_seed(0)
    seconds = []
    for i in range(runs + 1):  # the first is a warm-up (connection, page faults)
        local = torch.randperm(n, generator=g).tolist()
        remote = torch.randperm(n, generator=g).tolist()
        rid = f"{tag}-{i}"
        receiver.call("expect", rid, remote, 120.0)
        pairs, step = list(zip(local, remote)), -(-n // 8)
        t0 = time.monotonic()
        for j in range(0, n, step):
            sender.call("send", rid, peer, pairs[j : j + step], j + step >= n)
        got = receiver.call("wait", [rid], 120.0)[rid]
        elapsed = time.monotonic() - t0
        assert got["status"] == "COMPLETE", got
        assert sender.call("wait", [rid], 30.0)[rid]["status"] == "COMPLETE"
        if i:
            seconds.append(elapsed)
    med = statistics.median(seconds)
    return {"seconds": seconds, "median_s": med, "gb_per_s": n * BLOCK_BYTES / med / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    reason = skip_reason()
    if reason:
        sys.exit(f"kv_netns: {reason}")
    mib, runs = (16, 3) if args.quick else (64, 5)
    n = mib * MIB // BLOCK_BYTES
    results: dict[str, dict] = {}
    with two_hosts() as hosts, tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        p, d = hosts.prefill, hosts.decode
        links = {
            "same-host CMA": (p, {"UCX_NET_DEVICES": "lo"}, p, {"UCX_NET_DEVICES": "lo"}, None),
            "same-host TCP": (
                p,
                {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"},
                p,
                {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"},
                None,
            ),
            "veth TCP": (p, p.ucx_env(), d, d.ucx_env(), None),
            "veth TCP loss 1%": (p, p.ucx_env(), d, d.ucx_env(), lambda: packet_loss(hosts, 1)),
        }
        no_netem = netem_unavailable(hosts)
        if no_netem is None:
            links["veth netem 20ms 1%"] = (
                p,
                p.ucx_env(),
                d,
                d.ucx_env(),
                lambda: netem(hosts, "delay 20ms loss 1%"),
            )
        for k, (label, (sh, senv, rh, renv, impair)) in enumerate(links.items()):
            with ExitStack() as stack:
                recv = _peer(rh, f"bench-recv-{k}", n, renv, logs)
                stack.callback(recv.stop)
                send = _peer(sh, f"bench-send-{k}", n, senv, logs)
                stack.callback(send.stop)
                recv.ready()
                send.ready()
                with impair() if impair else nullcontext():
                    results[label] = _measure(send, recv, n, runs, f"r{k}")
            print(
                f"{label:20s} {results[label]['gb_per_s']:7.3f} GB/s  "
                f"(median of {runs}: {results[label]['median_s'] * 1e3:.1f} ms for {mib} MiB)",
                flush=True,
            )
    base = results["same-host CMA"]["gb_per_s"]
    print(f"\nratios vs same-host CMA ({base:.3f} GB/s):")
    for label, r in results.items():
        r["ratio_vs_same_host"] = r["gb_per_s"] / base
        print(f"  {label:20s} {r['ratio_vs_same_host']:.2f}x")
    if no_netem:
        print(f"\nnetem row skipped: {no_netem}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {"mib": mib, "runs": runs, "results": results, "netem_skipped": no_netem}, indent=1
        )
    )


if __name__ == "__main__":
    main()
