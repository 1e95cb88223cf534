"""`pdserve up`: a whole local cluster as child processes of this one, restarted when they crash.

Life cycle: add the slots (etcd unless --etcd, N prefill + M decode workers, the router) and
start the supervisor's monitor, which starts them -> wait until the router answers, a decode
worker is ready and every worker either became ready or failed at least once (failed ones keep
being restarted; `up` never exits because one worker did not start) -> with --planner, start
the planner thread (planner_loop.py) -> serve the control port (and write the run file), print
the URL -> supervise until Ctrl-C / SIGTERM (or the router is in a crash loop: exit 1) -> stop
the planner, then workers (they drain), router, etcd; remove temporary directories.
"""
from __future__ import annotations

import argparse
import shutil
import signal
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

from cluster.net import free_port
from local_cluster.children import EtcdChild, RouterProcess
from local_cluster.control import remove_run_file, serve_control
from local_cluster.slots import RestartPolicy, SlotState
from local_cluster.supervisor import Supervisor


def up(args: argparse.Namespace) -> int:
    """Run a local cluster until Ctrl-C / SIGTERM; 1 if it could not serve at all."""
    from engine.models.prepare import resolve_model_path
    from engine.spec_decode.config import SpeculativeConfig
    from local_cluster.planner_loop import config_from_args, start_planner

    SpeculativeConfig.parse(args.speculative_config)  # a malformed one fails here, not N times
    if getattr(args, "planner", False):
        config_from_args(args)  # bad planner flags fail before anything starts
    args.model = str(resolve_model_path(args.model))  # prepare once, before N processes race
    run_dir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
    log_dir = Path(args.log_dir) if args.log_dir else run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    policy = RestartPolicy(backoff=args.restart_backoff, max_backoff=max(args.restart_backoff, 30.0),
                           max_restarts=args.max_restarts, window=args.restart_window,
                           startup_timeout=args.startup_timeout)
    etcd_ports = (free_port(), free_port())
    etcd = args.etcd or f"127.0.0.1:{etcd_ports[0]}"
    sup = Supervisor(args, etcd, log_dir, policy)
    control = None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if args.etcd is None:
            sup.add_slot("etcd", lambda: EtcdChild(run_dir / "etcd-data", log_dir / "etcd.log",
                                                   *etcd_ports), name="etcd")
        for role, count in (("prefill", args.prefill), ("decode", args.decode)):
            for _ in range(count):
                sup.add_slot(role)
        url = add_router(sup)
        sup.start()
        problem = wait_until_serving(sup, stop)
        if stop.is_set():
            return 0
        if problem:
            sup.say(f"error: {problem}")
            return 1
        if getattr(args, "planner", False):
            start_planner(sup, url)
        control = serve_control(sup, url)
        _print_banner(sup, url)
        return supervise(sup, stop)
    finally:
        stop_cluster(sup, control, run_dir)


def add_router(sup: Supervisor) -> str:
    """The router's slot, on --port (0: a free one, kept across restarts); returns its URL."""
    args = sup.args
    port = args.port or free_port()
    url = f"http://{args.host}:{port}"
    cmd = ["router", "--etcd", sup.etcd, "--cluster", args.cluster, "--host", args.host,
           "--port", str(port), "--model", args.model, *_router_lora_args(args),
           *(["--enable-dev-endpoints"] if getattr(args, "enable_sleep_mode", False) else []),
           *args.router_args]
    sup.add_slot("router", lambda: RouterProcess(cmd, sup.log_dir / "router.log", url), name="router")
    return url


def wait_until_serving(sup: Supervisor, stop: threading.Event) -> str | None:
    """Until the router is ready, a decode worker is ready and no worker is still on its first
    start; or, after --startup-timeout, the first two alone. A reason when it cannot serve."""
    deadline = time.monotonic() + sup.args.startup_timeout
    with sup.lock:
        first_start = {s.name for s in sup.slots if s.role in ("prefill", "decode")}
    while not stop.wait(0.2):
        with sup.lock:
            first_start -= {s.name for s in sup.slots if s.state is not SlotState.STARTING or s.restarts}
        router, decode, etcd = sup.states("router"), sup.states("decode"), sup.states("etcd")
        serving = SlotState.READY in router and SlotState.READY in decode
        if serving and (not first_start or time.monotonic() > deadline):
            return None
        for role, states in (("router", router), ("etcd", etcd), ("decode worker", decode)):
            if states and all(s is SlotState.CRASH_LOOP for s in states):
                return f"every {role} is in a crash loop; see the logs in {sup.log_dir}"
        if time.monotonic() > deadline:
            return f"the cluster did not come up within {sup.args.startup_timeout:.0f}s"
    return None  # stopped (Ctrl-C) while starting


def _print_banner(sup: Supervisor, url: str) -> None:
    args = sup.args
    ready = {r: sup.states(r).count(SlotState.READY) for r in ("prefill", "decode")}
    print(f"pdserve is up: {url}  ({ready['prefill']}/{args.prefill} prefill + "
          f"{ready['decode']}/{args.decode} decode ready, etcd {sup.etcd})")
    print(f"logs: {sup.log_dir}")
    print(f"""try:  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{{"model": "{Path(args.model).name}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'""")
    print("Ctrl-C stops the cluster; `pdserve scale prefill +1` adds a worker; `pdserve status` "
          "shows every process and its restarts.", flush=True)


def supervise(sup: Supervisor, stop: threading.Event) -> int:
    """Until `stop` is set (0), or the router is in a crash loop (1). The monitor thread does
    the restarting."""
    while not stop.wait(0.5):
        if SlotState.CRASH_LOOP in sup.states("router"):
            sup.say("error: the router is in a crash loop; stopping the cluster")
            return 1
    return 0


def stop_cluster(sup: Supervisor, control: ThreadingHTTPServer | None, run_dir: Path) -> None:
    """Control port and planner, then workers (they drain), router and etcd; run file, temp
    dirs."""
    print("stopping...", flush=True)
    if control is not None:
        control.shutdown()
    if sup.planner is not None:
        sup.planner.stop()  # no switch starts after this
    sup.stop_all()
    remove_run_file()
    shutil.rmtree(run_dir, ignore_errors=True)


def _router_lora_args(args) -> list[str]:
    """--enable-lora lets the router load / unload adapters at run time; --lora-modules
    makes it serve them from the start."""
    if not getattr(args, "enable_lora", False):
        return []
    return ["--enable-lora", *(["--lora-modules", *args.lora_modules] if args.lora_modules else [])]
