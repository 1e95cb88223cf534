"""`pdserve up`: a whole local cluster as child processes of this one.

Life cycle: start etcd (unless --etcd) -> start N prefill + M decode workers -> start the
router -> wait until the router answers and every worker is registered -> serve the control
port (and write the run file), print the URL -> supervise until Ctrl-C / SIGTERM (or the
router exits) -> stop workers (they drain), router, etcd; remove temporary directories.
`pdserve scale ROLE +K|-K` reaches `Supervisor.scale` through the control port (control.py).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
from http.server import ThreadingHTTPServer
from pathlib import Path

from cluster.etcd_server import EtcdServer
from cluster.net import free_port
from local_cluster.control import remove_run_file, serve_control
from local_cluster.launcher import ServiceProcess


class Supervisor:
    """The child processes of one `pdserve up` (workers by role, router, etcd's PID); the
    control server calls `scale` and `snapshot` from its threads."""

    def __init__(self, args: argparse.Namespace, etcd_endpoint: str, log_dir: Path) -> None:
        self.args = args
        self.etcd = etcd_endpoint
        self.log_dir = log_dir
        self.workers: dict[str, list] = {"prefill": [], "decode": []}
        self.router = None
        self.retiring: list = []  # scaled-in workers still draining
        self.etcd_pid: int | None = None  # when `up` started etcd itself
        self.lock = threading.Lock()
        self._serial = 0

    def _threads(self) -> int:
        total = max(1, len(self.workers["prefill"]) + len(self.workers["decode"]))
        return max(1, (os.cpu_count() or 2) // total) if self.args.num_threads == 0 else self.args.num_threads

    def start_worker(self, role: str) -> ServiceProcess:
        with self.lock:
            self._serial += 1
            name = f"{role}-{self._serial}"
        cmd = [role, "--etcd", self.etcd, "--cluster", self.args.cluster, "--model", self.args.model,
               "--num-threads", str(self._threads()), *self.args.worker_args]
        proc = ServiceProcess(cmd, self.log_dir / f"{name}.log")
        with self.lock:
            self.workers[role].append(proc)
        return proc

    def stop_newest(self, role: str) -> bool:
        with self.lock:
            if not self.workers[role]:
                return False
            proc = self.workers[role].pop()
            self.retiring.append(proc)
        threading.Thread(target=proc.terminate, daemon=True).start()  # drains, then exits
        return True

    def scale(self, role: str, delta: int) -> dict:
        if role not in self.workers:
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        if delta > 0:
            for proc in [self.start_worker(role) for _ in range(delta)]:
                proc.wait_ready()
        else:
            for _ in range(-delta):
                if not self.stop_newest(role):
                    break
        return self.snapshot()

    def snapshot(self) -> dict:
        """Live child PIDs by role (workers, router, etcd)."""
        with self.lock:
            out = {role: [p.pid for p in procs if p.alive()] for role, procs in self.workers.items()}
        out["router"] = [self.router.pid] if self.router is not None and self.router.alive() else []
        out["etcd"] = [self.etcd_pid] if self.etcd_pid else []
        return out

    def stop_all(self) -> None:
        with self.lock:
            procs = [p for procs in self.workers.values() for p in procs] + self.retiring
            self.workers = {"prefill": [], "decode": []}
            self.retiring = []
        threads = [threading.Thread(target=p.terminate) for p in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.router is not None:
            self.router.terminate()


def up(args: argparse.Namespace) -> int:
    """Run a local cluster until Ctrl-C / SIGTERM; 1 if the router exited on its own."""
    from engine.models.loader import resolve_model_path

    args.model = str(resolve_model_path(args.model))  # prepare once, before N processes race
    run_dir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
    log_dir = Path(args.log_dir) if args.log_dir else run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    etcd = start_etcd(args, log_dir)
    sup = Supervisor(args, args.etcd or etcd.endpoint, log_dir)
    sup.etcd_pid = etcd.proc.pid if etcd is not None else None
    control = None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        start_workers(sup)
        url = start_router(sup)
        wait_until_serving(sup, url)
        control = serve_control(sup, url)
        _print_banner(sup, url)
        return supervise(sup, stop)
    finally:
        stop_cluster(sup, control, etcd, run_dir)


def start_etcd(args: argparse.Namespace, log_dir: Path) -> EtcdServer | None:
    """An etcd of our own, unless --etcd names one (then None)."""
    if args.etcd is not None:
        return None
    return EtcdServer(log_path=log_dir / "etcd.log").start()


def start_workers(sup: Supervisor) -> None:
    """--prefill prefill and --decode decode workers (not waited for)."""
    for role, count in (("prefill", sup.args.prefill), ("decode", sup.args.decode)):
        for _ in range(count):
            sup.start_worker(role)


def start_router(sup: Supervisor) -> str:
    """The router on --port (0: a free one); returns its URL (not waited for)."""
    args = sup.args
    port = args.port or free_port()
    sup.router = ServiceProcess(
        ["router", "--etcd", sup.etcd, "--cluster", args.cluster, "--host", args.host,
         "--port", str(port), "--model", args.model, *args.router_args],
        sup.log_dir / "router.log",
    )
    return f"http://{args.host}:{port}"


def wait_until_serving(sup: Supervisor, url: str) -> None:
    """Every worker printed READY, the router answers and every worker is registered (not
    draining) in etcd; RuntimeError after --startup-timeout."""
    import asyncio

    from cluster.registration import list_workers, make_client

    args = sup.args
    for procs in sup.workers.values():
        for proc in procs:
            proc.wait_ready()
    expected, timeout = args.prefill + args.decode, args.startup_timeout

    async def registered() -> int:
        async with make_client(sup.etcd) as client:
            return len([w for w in await list_workers(client, args.cluster) if not w.draining])

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/v1/models", timeout=2)
            if asyncio.run(registered()) >= expected:
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the cluster did not come up within {timeout:.0f}s")


def _print_banner(sup: Supervisor, url: str) -> None:
    args = sup.args
    print(f"pdserve is up: {url}  ({args.prefill} prefill + {args.decode} decode, etcd {sup.etcd})")
    print(f"logs: {sup.log_dir}")
    print(f"""try:  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{{"model": "{Path(args.model).name}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'""")
    print("Ctrl-C stops the cluster; `pdserve scale prefill +1` adds a worker.", flush=True)


def supervise(sup: Supervisor, stop: threading.Event) -> int:
    """Until `stop` is set (0), or the router exits (1)."""
    while not stop.wait(1.0):
        if sup.router is not None and not sup.router.alive():
            print("the router exited; stopping the cluster", flush=True)
            return 1
    return 0


def stop_cluster(
    sup: Supervisor, control: ThreadingHTTPServer | None, etcd: EtcdServer | None, run_dir: Path
) -> None:
    """Control port, then workers (they drain) and router, then etcd; run file, temp dirs."""
    print("stopping...", flush=True)
    if control is not None:
        control.shutdown()
    sup.stop_all()
    if etcd is not None:
        etcd.stop()
    remove_run_file()
    if not sup.args.log_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
