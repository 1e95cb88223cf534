"""What etcd authentication costs a joining worker (docs/security.md): the time from a new worker's
`Registrar.start` (connect; with a user, etcd's Authenticate; lease; first put) until a
router's watch (`EtcdWatcher`, its own user) has it in the registry, and the registration
alone, on an open etcd, one with users (as `pdserve up` starts it), and one with users over
TLS with client certificates (when the openssl CLI can make a throwaway CA). All three in
the same run, interleaved.

    python benchmarks/etcd_auth_bench.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from cluster.etcd_auth import etcd_users
from cluster.etcd_security import EtcdCredentials
from cluster.etcd_server import EtcdServer
from cluster.registration import Registrar, WorkerInfo
from router.placement.registry import EtcdWatcher, WorkerRegistry

# The throwaway CA the tests use (tests/throwaway_pki.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from throwaway_pki import etcd_tls, openssl_available  # noqa: E402

CLUSTER = "bench"


async def _join(
    endpoint: str, worker: EtcdCredentials | None, registry: WorkerRegistry, worker_id: str
) -> tuple[float, float]:
    """(ms until registered, ms until the router's registry has it)."""
    info = WorkerInfo(worker_id, "decode", "127.0.0.1:1", "m", "c", 16)
    start = time.perf_counter()
    registrar = Registrar(endpoint, CLUSTER, lambda: info, ttl_s=5, credentials=worker)
    await registrar.start()
    registered = time.perf_counter()
    while registry.get(worker_id) is None:
        await asyncio.sleep(0.0005)
    seen = time.perf_counter()
    await registrar.deregister()
    return (registered - start) * 1e3, (seen - start) * 1e3


async def _run(setups: dict, rounds: int) -> dict[str, tuple[list[float], list[float]]]:
    watches, registries = [], {}
    for name, (endpoint, worker, router) in setups.items():
        registries[name] = WorkerRegistry()
        watcher = EtcdWatcher(registries[name], endpoint, CLUSTER, credentials=router)
        watches.append(asyncio.create_task(watcher.run()))
        await registries[name].synced.wait()
    out: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in setups}
    for i in range(rounds + 3):  # the first 3: warm-up
        for name, (endpoint, worker, _) in setups.items():
            reg, seen = await _join(endpoint, worker, registries[name], f"w{i}")
            if i >= 3:
                out[name][0].append(reg)
                out[name][1].append(seen)
    for task in watches:
        task.cancel()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument(
        "--bcrypt-cost",
        type=int,
        default=4,
        help="etcd's --bcrypt-cost (pdserve up: 4; etcd's default: 10)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        users = etcd_users(CLUSTER, Path(tmp))
        users = replace(users, auth=replace(users.auth, bcrypt_cost=args.bcrypt_cost))
        tls = etcd_tls(Path(tmp)) if openssl_available() else None
        servers = {"open": EtcdServer(), "users": EtcdServer(auth=users.auth)}
        if tls is not None:
            servers["users + TLS"] = EtcdServer(auth=users.auth, tls=tls)
        try:
            for server in servers.values():
                server.start()
            worker, router = users.worker.resolve({}), users.router.resolve({})
            setups = {
                "open": (servers["open"].endpoint, None, None),
                "users": (servers["users"].endpoint, worker, router),
            }
            if tls is not None:
                files = dict(etcd_ca=str(tls.ca), etcd_cert=str(tls.cert), etcd_key=str(tls.key))
                setups["users + TLS"] = (
                    servers["users + TLS"].endpoint,
                    replace(users.worker, **files).resolve({}),
                    replace(users.router, **files).resolve({}),
                )
            results = asyncio.run(_run(setups, args.rounds))
        finally:
            for server in servers.values():
                server.stop()
    print(f"{args.rounds} joins each, bcrypt cost {args.bcrypt_cost}; median (p90) ms")
    print(f"{'etcd':12} {'registered':>18} {'in the router':>18}")
    for name, (reg, seen) in results.items():
        q = lambda xs: f"{statistics.median(xs):6.2f} ({statistics.quantiles(xs, n=10)[-1]:6.2f})"  # noqa: E731
        print(f"{name:12} {q(reg):>18} {q(seen):>18}")


if __name__ == "__main__":
    main()
