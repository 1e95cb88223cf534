"""`pdserve up` (a whole local cluster as child processes), `pdserve scale`, `pdserve status`.

Life cycle of `pdserve up`: start etcd (unless --etcd) -> N prefill + M decode workers and the
router -> wait until the router answers and every worker is registered -> print the URL ->
supervise until Ctrl-C / SIGTERM -> stop workers (they drain), router, etcd; remove temporary
directories. `pdserve scale ROLE +K|-K` asks the running `up` (over a loopback control port
recorded in the run file) to start workers, or to drain and stop its newest ones.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

RUN_FILE = "current-cluster.json"


def _run_file() -> Path:
    root = os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve"
    return Path(root) / "run" / RUN_FILE


class Supervisor:
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

    def start_worker(self, role: str):
        from local_cluster.launcher import ServiceProcess

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


def _control_server(supervisor: Supervisor) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            self._reply(200, supervisor.snapshot())

        def do_POST(self):  # noqa: N802
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                self._reply(200, supervisor.scale(body["role"], int(body["delta"])))
            except (ValueError, KeyError, RuntimeError) as exc:
                self._reply(400, {"error": str(exc)})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _wait_until_serving(url: str, etcd: str, cluster: str, expected: int, timeout: float) -> None:
    import asyncio

    from cluster.registration import list_workers, make_client

    async def registered() -> int:
        async with make_client(etcd) as client:
            return len([w for w in await list_workers(client, cluster) if not w.draining])

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


def up(args: argparse.Namespace) -> int:
    from cluster.etcd_server import EtcdServer
    from local_cluster.launcher import ServiceProcess
    from cluster.net import free_port
    from engine.models.loader import resolve_model_path

    args.model = str(resolve_model_path(args.model))  # prepare once, before N processes race
    run_dir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
    log_dir = Path(args.log_dir) if args.log_dir else run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    etcd = None
    if args.etcd is None:
        etcd = EtcdServer(log_path=log_dir / "etcd.log").start()
    endpoint = args.etcd or etcd.endpoint
    sup = Supervisor(args, endpoint, log_dir)
    sup.etcd_pid = etcd.proc.pid if etcd is not None else None
    control = None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        for role, count in (("prefill", args.prefill), ("decode", args.decode)):
            for _ in range(count):
                sup.start_worker(role)
        port = args.port or free_port()
        sup.router = ServiceProcess(
            ["router", "--etcd", endpoint, "--cluster", args.cluster, "--host", args.host,
             "--port", str(port), "--model", args.model, *args.router_args],
            log_dir / "router.log",
        )
        for procs in sup.workers.values():
            for proc in procs:
                proc.wait_ready()
        url = f"http://{args.host}:{port}"
        _wait_until_serving(url, endpoint, args.cluster, args.prefill + args.decode, args.startup_timeout)
        control = _control_server(sup)
        run_file = _run_file()
        run_file.parent.mkdir(parents=True, exist_ok=True)
        run_file.write_text(json.dumps({
            "pid": os.getpid(), "url": url, "etcd": endpoint, "cluster": args.cluster,
            "control": f"http://127.0.0.1:{control.server_address[1]}", "logs": str(log_dir),
        }))
        print(f"pdserve is up: {url}  ({args.prefill} prefill + {args.decode} decode, etcd {endpoint})")
        print(f"logs: {log_dir}")
        print(f"""try:  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{{"model": "{Path(args.model).name}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'""")
        print("Ctrl-C stops the cluster; `pdserve scale prefill +1` adds a worker.", flush=True)
        while not stop.wait(1.0):
            if sup.router is not None and not sup.router.alive():
                print("the router exited; stopping the cluster", flush=True)
                return 1
        return 0
    finally:
        print("stopping...", flush=True)
        if control is not None:
            control.shutdown()
        sup.stop_all()
        if etcd is not None:
            etcd.stop()
        run_file = _run_file()
        try:
            if json.loads(run_file.read_text()).get("pid") == os.getpid():
                run_file.unlink()
        except (OSError, ValueError):
            pass
        if not args.log_dir:
            shutil.rmtree(run_dir, ignore_errors=True)


def _current() -> dict:
    try:
        return json.loads(_run_file().read_text())
    except (OSError, ValueError):
        raise ValueError("no running `pdserve up` found (start one, or pass --etcd)") from None


def scale(args: argparse.Namespace) -> int:
    sign = args.delta[0]
    if sign not in "+-" or not args.delta[1:].isdigit():
        raise ValueError(f"delta must look like +1 or -2, got {args.delta!r}")
    delta = int(args.delta)
    req = urllib.request.Request(
        _current()["control"] + "/scale", data=json.dumps({"role": args.role, "delta": delta}).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        print(json.dumps(json.loads(resp.read()), indent=2))
    return 0


def status(args: argparse.Namespace) -> int:
    import asyncio

    from cluster.registration import list_workers, make_client

    etcd = args.etcd or _current()["etcd"]
    cluster = args.cluster or (_current()["cluster"] if not args.etcd else "default")

    async def fetch():
        async with make_client(etcd) as client:
            return await list_workers(client, cluster)

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
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--worker-arg", dest="worker_args", action="append", default=[],
                   help="extra flag for every worker, e.g. --worker-arg=--kv-cache-memory=1GiB")
    p.add_argument("--router-arg", dest="router_args", action="append", default=[],
                   help="extra flag for the router, e.g. --router-arg=--policy=round_robin")
    p.set_defaults(func=up)

    p = subparsers.add_parser("scale", help="add or drain workers of the running `pdserve up`")
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("delta", help="+K to start K workers, -K to drain and stop K")
    p.set_defaults(func=scale)

    p = subparsers.add_parser("status", help="list registered workers and their capacity")
    p.add_argument("--etcd", default=None, help="etcd host:port (default: the running `pdserve up`)")
    p.add_argument("--cluster", default=None)
    p.set_defaults(func=status)
