"""The `pdserve up`, `pdserve scale` and `pdserve status` subcommands. `up` runs the
supervisor (up.py); `scale` asks the running `up` over its control port, and `status` lists its
processes (state, restarts) and the workers registered in etcd (control.py says where both find
the running `up`)."""
from __future__ import annotations

import argparse
import json
import time
import urllib.request

from engine.config import KV_CACHE_DTYPES
from local_cluster.control import current
from local_cluster.up import up


def scale(args: argparse.Namespace) -> int:
    sign = args.delta[0]
    if sign not in "+-" or not args.delta[1:].isdigit():
        raise ValueError(f"delta must look like +1 or -2, got {args.delta!r}")
    delta = int(args.delta)
    req = urllib.request.Request(
        current()["control"] + "/scale", data=json.dumps({"role": args.role, "delta": delta}).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )
    with urllib.request.urlopen(req, timeout=900) as resp:  # up to --startup-timeout per worker
        print(json.dumps(json.loads(resp.read()), indent=2))
    return 0


def status(args: argparse.Namespace) -> int:
    import asyncio

    from cluster.registration import list_workers, make_client

    etcd = args.etcd or current()["etcd"]
    cluster = args.cluster or (current()["cluster"] if not args.etcd else "default")

    async def fetch():
        async with make_client(etcd) as client:
            return await list_workers(client, cluster)

    if not args.etcd:
        _print_processes()
    workers = sorted(asyncio.run(fetch()), key=lambda w: (w.role, w.worker_id))
    print(f"{'role':8} {'worker':32} {'address':22} {'state':9} {'free/total blocks':>18} "
          f"{'running':>8} {'waiting':>8} {'queued prefill':>15}")
    for w in workers:
        c = w.capacity
        print(f"{w.role:8} {w.worker_id:32} {w.grpc_address:22} {'draining' if w.draining else 'ready':9} "
              f"{c.free_blocks:>8}/{c.total_blocks:<9} {c.running:>8} {c.waiting:>8} {c.queued_prefill_tokens:>15}")
    if not workers:
        print(f"(no workers registered in cluster {cluster!r} at {etcd})")
    return 0


def _print_processes() -> None:
    """The running `up`'s slots: role, pid, state, restarts, last exit code; the planner's
    state with --planner."""
    try:
        with urllib.request.urlopen(current()["control"], timeout=5) as resp:
            doc = json.loads(resp.read())
            slots = doc["slots"]
    except OSError as exc:
        print(f"(the running `pdserve up` does not answer: {exc})\n")
        return
    print(f"{'process':12} {'role':8} {'pid':>8} {'state':11} {'restarts':>8} {'last exit':>9}")
    for s in slots:
        pid = "-" if s["pid"] is None else s["pid"]
        code = "-" if s["last_exit"] is None else s["last_exit"]
        print(f"{s['name']:12} {s['role']:8} {pid:>8} {s['state']:11} {s['restarts']:>8} {code:>9}")
    print()
    if "planner" in doc:
        _print_planner(doc["planner"])


def _print_planner(planner: dict) -> None:
    """Pool sizes and loads, the last decision and the latest moves of `up --planner`."""
    pools, loads = planner["pools"], planner["loads"]
    load = {k: "-" if v is None else f"{v:.2f}" for k, v in loads.items()}
    print(f"planner: prefill {pools['prefill']} (load {load.get('prefill', '-')}), decode "
          f"{pools['decode']} (load {load.get('decode', '-')}); {planner['move_count']} moves")
    if planner["last_decision"]:
        print(f"  last decision: {planner['last_decision']}")
    for m in planner["moves"][-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(m["at"]))
        outcome = "ok" if m["ok"] else f"failed: {m['error']}"
        print(f"  {when} {m['slot'] or m['worker_id']} {m['from_role']} -> {m['to_role']} ({outcome})")
    print()


def register(subparsers) -> None:
    p = subparsers.add_parser("up", help="start a local cluster: etcd + router + prefill/decode workers")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers to start")
    p.add_argument("--decode", type=int, default=1, help="decode workers to start")
    p.add_argument("--model", default="default", help="HF LLaMA directory, GGUF file or 'default'")
    p.add_argument("--host", default="127.0.0.1", help="router listen address")
    p.add_argument("--port", type=int, default=8000, help="router port (0 = any free port)")
    p.add_argument("--etcd", default=None, help="use this etcd (host:port) instead of starting one")
    p.add_argument("--cluster", default="default", help="cluster name in etcd")
    p.add_argument("--num-threads", type=int, default=0,
                   help="torch threads per worker (0 = cores / workers, at least 1)")
    p.add_argument("--log-dir", default=None, help="keep per-process logs here (default: a temp dir)")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds a process may take to become ready before it counts as crashed; "
                        "also how long `up` waits for workers still on their first start")
    p.add_argument("--restart-backoff", type=float, default=1.0,
                   help="seconds before restarting a crashed process, doubled per further crash "
                        "within --restart-window (capped at 30 s)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of one process allowed within --restart-window; one crash more "
                        "is a crash loop and it is not restarted again (0 = never restart)")
    p.add_argument("--restart-window", type=float, default=300.0,
                   help="seconds a crash counts towards --max-restarts and the backoff")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding on the decode workers (prefill workers never '
                        'speculate), as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        'or \'{"method": "draft_model", "model": "self:8" | PATH, '
                        '"num_speculative_tokens": 3}\'')
    p.add_argument("--kv-cache-dtype", default=None, choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage of every worker, both roles (vLLM's kv_cache_dtype): "
                        "auto (model dtype), fp8 (= fp8_e4m3), fp8_e5m2, int8; a prefill worker "
                        "sends KV only to decode workers of the same format")
    p.add_argument("--enable-sleep-mode", action="store_true",
                   help="sleep mode on every worker (both roles) and the router's fleet-wide "
                        "admin endpoints (--enable-dev-endpoints: /sleep, /wake_up, "
                        "/is_sleeping, /reset_prefix_cache, /collective_rpc, /update_weights)")
    g = p.add_argument_group("LoRA adapters (passed to the workers of both roles and the router)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters; also enables the router's /v1/load_lora_adapter "
                        "and /v1/unload_lora_adapter")
    g.add_argument("--max-loras", type=int, default=None, help="distinct adapters in one batch")
    g.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded on the CPU per worker")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="adapters loaded at start, served as model NAME")
    g = p.add_argument_group(
        "planner (docs/planner.md): move workers between the pools from measured load and SLOs")
    g.add_argument("--planner", action="store_true",
                   help="switch workers between prefill and decode in place (Worker.SetRole) "
                        "when a pool misses its SLO or is the bottleneck; without it the pools "
                        "stay as --prefill / --decode (and `pdserve scale`) set them")
    g.add_argument("--ttft-slo-ms", type=float, default=2000.0,
                   help="time-to-first-token SLO the planner holds the window's quantile to")
    g.add_argument("--itl-slo-ms", type=float, default=250.0,
                   help="inter-token-gap SLO the planner holds the window's quantile to")
    g.add_argument("--planner-quantile", type=float, default=0.9,
                   help="quantile of the window's TTFTs and ITLs compared with the SLOs")
    g.add_argument("--planner-interval", type=float, default=5.0,
                   help="seconds between planner rounds (measure, decide, maybe move)")
    g.add_argument("--planner-window", type=float, default=20.0,
                   help="seconds of measurements each decision looks at")
    g.add_argument("--planner-cooldown", type=float, default=30.0,
                   help="seconds after a move before the next one")
    g.add_argument("--planner-hysteresis", type=float, default=0.15,
                   help="a move must lower the bottleneck pool's load (1 = saturated) by this much")
    g.add_argument("--planner-high-load", type=float, default=0.85,
                   help="a pool at this load is relieved even while its SLO holds")
    g.add_argument("--planner-min-requests", type=int, default=3,
                   help="fewer requests in the window: the planner does not act")
    g.add_argument("--planner-drain-timeout", type=float, default=30.0,
                   help="seconds a switching worker waits for its in-flight requests")
    g.add_argument("--min-prefill", type=int, default=0,
                   help="the planner keeps at least this many prefill workers (0: decode "
                        "workers prefill locally)")
    g.add_argument("--max-prefill", type=int, default=None, help="at most this many prefill workers")
    g.add_argument("--min-decode", type=int, default=1, help="at least this many decode workers")
    g.add_argument("--max-decode", type=int, default=None, help="at most this many decode workers")
    p.add_argument("--worker-arg", dest="worker_args", action="append", default=[],
                   help="extra flag for every worker, e.g. --worker-arg=--kv-cache-memory=1GiB")
    p.add_argument("--prefill-arg", dest="prefill_args", action="append", default=[],
                   help="extra flag for prefill workers only (after the --worker-arg ones)")
    p.add_argument("--decode-arg", dest="decode_args", action="append", default=[],
                   help="extra flag for decode workers only (after the --worker-arg ones)")
    p.add_argument("--router-arg", dest="router_args", action="append", default=[],
                   help="extra flag for the router, e.g. --router-arg=--policy=round_robin")
    p.set_defaults(func=up)

    p = subparsers.add_parser("scale", help="add or drain workers of the running `pdserve up`")
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("delta", help="+K to start K workers, -K to drain and stop K")
    p.set_defaults(func=scale)

    p = subparsers.add_parser(
        "status", help="processes of the running `pdserve up` (state, restarts) and the registered workers")
    p.add_argument("--etcd", default=None, help="etcd host:port (default: the running `pdserve up`)")
    p.add_argument("--cluster", default=None)
    p.set_defaults(func=status)
