"""The `pdserve up`, `pdserve scale` and `pdserve status` subcommands. `up` parses its flags
into an UpConfig once (config.py; the flags come from its fields) and runs the supervisor
(up.py); `scale` asks the running `up` over its control port, and `status` lists its processes
(state, restarts) and the workers registered in etcd with their load and KV use, second tier
included, and their KV transfer self-test (control.py says where both find the running `up`)."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

from cluster.etcd_security import GROUP as ETCD_GROUP
from cluster.etcd_security import EtcdSecurity
from cluster.roles import ROLES
from engine.flags import add_flags, from_args
from local_cluster.config import UpConfig
from local_cluster.run_file import control_request, current, etcd_credentials
from local_cluster.up import up

if TYPE_CHECKING:
    from cluster.registration import WorkerInfo


def scale(args: argparse.Namespace) -> int:
    sign = args.delta[0]
    if sign not in "+-" or not args.delta[1:].isdigit():
        raise ValueError(f"delta must look like +1 or -2, got {args.delta!r}")
    delta = int(args.delta)
    reply = control_request(
        current(), "/scale", {"role": args.role, "delta": delta}, timeout=900
    )  # up to --startup-timeout per worker
    print(json.dumps(json.loads(reply), indent=2))
    return 0


def status(args: argparse.Namespace) -> int:
    import asyncio

    from cluster.block_hash_agreement import REASON, probe_refusal
    from cluster.registration import list_workers, make_client

    etcd = args.etcd or current()["etcd"]
    cluster = args.cluster or (current()["cluster"] if not args.etcd else "default")
    credentials = (
        from_args(EtcdSecurity, args).resolve() if args.etcd else etcd_credentials(current())
    )

    async def fetch():
        async with make_client(etcd, credentials) as client:
            return await list_workers(client, cluster)

    if not args.etcd:
        _print_processes()
    workers = sorted(asyncio.run(fetch()), key=lambda w: (w.role, w.worker_id))
    print("\n".join(worker_table(workers)))
    for note in selftest_notes(workers):
        print(note)
    for w in workers:
        why = probe_refusal(w)
        if why:
            print(f"refused {w.worker_id} ({REASON}): {why}")
    if not workers:
        print(f"(no workers registered in cluster {cluster!r} at {etcd})")
    return 0


def worker_table(workers: list[WorkerInfo]) -> list[str]:
    """`pdserve status`'s lines for the registered workers: a header, then one per worker
    (its second KV tier's used/total blocks, `-` without a tier; its KV transfer self-test:
    GB/s and ratio to memcpy, `failed`, or `-` when not run — docs/kvtransfer.md)."""
    from cluster.block_hash_agreement import probe_refusal

    lines = [
        f"{'role':8} {'worker':32} {'address':22} {'state':9} {'free/total blocks':>18} "
        f"{'KV tier used/total':>19} {'running':>8} {'waiting':>8} {'queued prefill':>15} "
        f"{'KV xfer GB/s (x memcpy)':>23}"
    ]
    for w in workers:
        c = w.capacity
        tier = (
            f"{c.kv_offload_used_blocks:>9}/{c.kv_offload_total_blocks:<9}"
            if c.kv_offload_total_blocks
            else f"{'-':>9} {'':9}"
        )
        state = "refused" if probe_refusal(w) else "draining" if w.draining else "ready"
        lines.append(
            f"{w.role:8} {w.worker_id:32} {w.grpc_address:22} {state:9} "
            f"{c.free_blocks:>8}/{c.total_blocks:<9} {tier} {c.running:>8} "
            f"{c.waiting:>8} {c.queued_prefill_tokens:>15} {selftest_cell(w):>23}"
        )
    return lines


def selftest_cell(w: WorkerInfo) -> str:
    """A worker's KV transfer self-test in `pdserve status`: `9.85 (0.61x)`, `failed`, `-`."""
    t = w.transfer_selftest
    if t is None:
        return "-"
    if t.path.startswith("failed"):
        return "failed"
    return f"{t.gbps:.2f} ({t.ratio:.2f}x)"


def selftest_notes(workers: list[WorkerInfo]) -> list[str]:
    """One line per worker whose self-test failed or ran below the warning ratio: the path
    and why, which the table has no room for."""
    from kvtransfer.selftest import LOW_RATIO

    notes = []
    for w in workers:
        t = w.transfer_selftest
        if t is not None and t.path.startswith("failed"):
            notes.append(f"KV transfer self-test of {w.worker_id} {t.path}")
        elif t is not None and t.ratio < LOW_RATIO:
            notes.append(
                f"KV transfer self-test of {w.worker_id}: slow path, {t.gbps:.2f} GB/s = "
                f"{t.ratio:.2f}x memcpy over {t.path} (docs/kvtransfer.md)"
            )
    return notes


def _print_processes() -> None:
    """The running `up`'s slots: role, pid, state, restarts, last exit code; the planner's
    state with --planner."""
    try:
        doc = json.loads(control_request(current()))
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
    print(
        f"planner: prefill {pools['prefill']} (load {load.get('prefill', '-')}), decode "
        f"{pools['decode']} (load {load.get('decode', '-')}); {planner['move_count']} moves"
    )
    if planner["last_decision"]:
        print(f"  last decision: {planner['last_decision']}")
    for m in planner["moves"][-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(m["at"]))
        outcome = "ok" if m["ok"] else f"failed: {m['error']}"
        print(
            f"  {when} {m['slot'] or m['worker_id']} {m['from_role']} -> {m['to_role']} ({outcome})"
        )
    print()


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "up", help="start a local cluster: etcd + router + prefill/decode workers"
    )
    add_flags(p, UpConfig)
    p.set_defaults(func=lambda args: up(from_args(UpConfig, args)))

    p = subparsers.add_parser("scale", help="add or drain workers of the running `pdserve up`")
    p.add_argument("role", choices=ROLES)
    p.add_argument("delta", help="+K to start K workers, -K to drain and stop K")
    p.set_defaults(func=scale)

    p = subparsers.add_parser(
        "status",
        help="processes of the running `pdserve up` (state, restarts) and the registered workers",
    )
    p.add_argument(
        "--etcd", default=None, help="etcd host:port (default: the running `pdserve up`)"
    )
    p.add_argument("--cluster", default=None)
    add_flags(p, EtcdSecurity, group=ETCD_GROUP + "; with --etcd (else the running `up`'s)")
    p.set_defaults(func=status)
