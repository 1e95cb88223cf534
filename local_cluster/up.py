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

import dataclasses
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

from cluster.etcd_auth import etcd_users
from cluster.etcd_security import EtcdSecurity
from cluster.grpc_security import ClusterAuth, resolve, write_token_file
from cluster.net import free_port
from cluster.roles import ROLES, Role
from cluster.secret_files import with_absolute_paths, write_secret_file
from engine.config import EngineConfig
from engine.flags import to_argv
from local_cluster.children import EtcdChild, RouterProcess
from local_cluster.config import UpConfig
from local_cluster.control import remove_run_file, serve_control
from local_cluster.slots import SlotState
from local_cluster.supervisor import Supervisor

LOOPBACK_CIDRS = ("127.0.0.0/8", "::1/128")


def up(config: UpConfig) -> int:
    """Run a local cluster until Ctrl-C / SIGTERM; 1 if it could not serve at all."""
    from engine.models.prepare import resolve_model_path
    from local_cluster.planner_loop import start_planner

    if config.etcd is not None:  # a missing password or file stops the start (exit 2)
        config.etcd_security.resolve()
    resolve(config.grpc_security, os.environ)  # a refused token or TLS file: exit 2 at once
    model = str(resolve_model_path(config.engine.model))  # prepare once, before N processes race
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, model=model))
    run_dir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
    config, auth = cluster_security(config, run_dir)
    config = client_key(config, run_dir)
    log_dir = Path(config.log_dir) if config.log_dir else run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    etcd_ports = (free_port(), free_port())
    etcd = config.etcd or f"127.0.0.1:{etcd_ports[0]}"
    if config.etcd is None:  # our etcd, our users: passwords in 0600 files in the 0700 run_dir
        users = etcd_users(config.cluster, run_dir)
        worker_etcd, router_etcd = users.worker, users.router
    else:
        worker_etcd = router_etcd = with_absolute_paths(config.etcd_security, "etcd_user")
    sup = Supervisor(config, etcd, log_dir, worker_etcd, router_etcd)
    control = None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if config.etcd is None:
            sup.add_slot(
                "etcd",
                lambda: EtcdChild(
                    run_dir / "etcd-data", log_dir / "etcd.log", *etcd_ports, auth=users.auth
                ),
                name="etcd",
            )
        assert config.prefill is not None  # UpConfig.__post_init__ resolves it
        for role, count in ((Role.PREFILL, config.prefill), (Role.DECODE, config.decode)):
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
        if config.planner:
            start_planner(sup, url, auth)
        control = serve_control(sup, url)
        _print_banner(sup, url)
        return supervise(sup, stop)
    finally:
        stop_cluster(sup, control, run_dir)


def cluster_security(config: UpConfig, run_dir: Path) -> tuple[UpConfig, ClusterAuth]:
    """The cluster's gRPC security, by absolute path, and what it resolves to: the user's
    --cluster-token-file, else PDSERVE_CLUSTER_TOKEN (the children inherit it), else a random
    token made for this cluster in `run_dir`/cluster-token (0600; removed with `run_dir` when
    `up` stops). --tls-* files pass through as given."""
    security = config.grpc_security.absolute()
    auth = resolve(security, os.environ)
    if auth.token is None:
        path = write_token_file(run_dir / "cluster-token")
        security = dataclasses.replace(security, cluster_token_file=str(path))
        auth = resolve(security, os.environ)
    return dataclasses.replace(config, grpc_security=security), auth


def client_key(config: UpConfig, run_dir: Path) -> UpConfig:
    """With --generate-api-key: a random API key in `run_dir`/api-key (0600; removed with
    `run_dir`), given to the router as its --api-key-file; else `config` as it is."""
    if not config.generate_api_key:
        return config
    path = write_secret_file(run_dir / "api-key", secrets.token_urlsafe(32), exclusive=True)
    return dataclasses.replace(config, api_key_file=str(path), generate_api_key=False)


def add_router(sup: Supervisor) -> str:
    """The router's slot, on --port (0: a free one, kept across restarts); returns its URL."""
    port = sup.config.port or free_port()
    url = f"http://{sup.config.host}:{port}"
    cmd = ["router", *router_flags(sup.config, sup.etcd, port, sup.router_etcd)]
    sup.add_slot(
        "router", lambda: RouterProcess(cmd, sup.log_dir / "router.log", url), name="router"
    )
    return url


def router_flags(
    config: UpConfig, etcd: str, port: int, etcd_security: EtcdSecurity = EtcdSecurity()
) -> list[str]:
    """`pdserve router`'s flags: this cluster's, its etcd user, workers trusted on loopback
    only (the workers `up` starts listen there), the model, what the engine flags ask of the
    router (--enable-lora and --lora-modules: it serves the adapters and may load more at run
    time; --enable-sleep-mode: the fleet-wide admin endpoints; the grammar size and compile time
    limits, so that the router refuses what the workers would), the chat flags, then
    --router-arg's. Written out, since `local_cluster` never imports `router`
    (tests/test_imports.py); a test parses them with the router's own parser."""
    c, engine = config, config.engine
    out = [
        "--etcd",
        etcd,
        *to_argv(etcd_security),
        "--cluster",
        c.cluster,
        "--host",
        c.host,
        "--port",
        str(port),
        "--allowed-worker-cidrs",
        *LOOPBACK_CIDRS,
        "--model",
        engine.model,
    ]
    if engine.enable_lora:
        out.append("--enable-lora")
        if engine.lora_modules:
            out += ["--lora-modules", *map(str, engine.lora_modules)]
    if engine.enable_sleep_mode:
        out.append("--enable-dev-endpoints")
    default = EngineConfig()
    if engine.max_grammar_bytes != default.max_grammar_bytes:
        out += ["--max-grammar-bytes", str(engine.max_grammar_bytes)]
    if engine.max_grammar_repetitions != default.max_grammar_repetitions:
        out += ["--max-grammar-repetitions", str(engine.max_grammar_repetitions)]
    if engine.grammar_compile_timeout_s not in (0, default.grammar_compile_timeout_s):
        out += ["--grammar-compile-timeout", repr(engine.grammar_compile_timeout_s)]
    for flag, path in (
        ("--api-key-file", c.api_key_file),
        ("--admin-api-key-file", c.admin_api_key_file),
    ):
        if path:
            out += [flag, str(Path(path).resolve())]
    out += to_argv(c.grpc_security.absolute())  # file paths: no secret on the command line
    out += to_argv(c.chat.absolute())
    return [*out, *c.router_args]


def wait_until_serving(sup: Supervisor, stop: threading.Event) -> str | None:
    """Until the router is ready, a decode worker is ready and no worker is still on its first
    start; or, after --startup-timeout, the first two alone. A reason when it cannot serve."""
    deadline = time.monotonic() + sup.policy.startup_timeout
    with sup.lock:
        first_start = {s.name for s in sup.slots if s.role in ROLES}
    while not stop.wait(0.2):
        with sup.lock:
            first_start -= {
                s.name for s in sup.slots if s.state is not SlotState.STARTING or s.restarts
            }
        router, decode, etcd = sup.states("router"), sup.states("decode"), sup.states("etcd")
        serving = SlotState.READY in router and SlotState.READY in decode
        if serving and (not first_start or time.monotonic() > deadline):
            return None
        for role, states in (("router", router), ("etcd", etcd), ("decode worker", decode)):
            if states and all(s is SlotState.CRASH_LOOP for s in states):
                return f"every {role} is in a crash loop; see the logs in {sup.log_dir}"
        if time.monotonic() > deadline:
            return f"the cluster did not come up within {sup.policy.startup_timeout:.0f}s"
    return None  # stopped (Ctrl-C) while starting


def _print_banner(sup: Supervisor, url: str) -> None:
    c = sup.config
    ready = {r: sup.states(r).count(SlotState.READY) for r in ROLES}
    print(
        f"pdserve is up: {url}  ({ready['prefill']}/{c.prefill} prefill + "
        f"{ready['decode']}/{c.decode} decode ready, etcd {sup.etcd})"
    )
    print(f"logs: {sup.log_dir}")
    if c.grpc_security.cluster_token_file:
        print(
            f"gRPC cluster token: {c.grpc_security.cluster_token_file} (e.g. `pdserve role "
            f"--worker HOST:PORT --cluster-token-file {c.grpc_security.cluster_token_file}`)"
        )
    auth = ""  # never the key itself: where the client finds it
    if c.api_key_file:
        auth = f' -H "Authorization: Bearer $(head -n1 {Path(c.api_key_file).resolve()})"'
    elif env := next((v for v in ("PDSERVE_API_KEY", "VLLM_API_KEY") if os.environ.get(v)), None):
        auth = f' -H "Authorization: Bearer ${env}"'
    print(f"""try:  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
        -d '{{"model": "{Path(c.engine.model).name}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'""")  # noqa: E501
    print(
        "Ctrl-C stops the cluster; `pdserve scale prefill +1` adds a worker; `pdserve status` "
        "shows every process and its restarts.",
        flush=True,
    )


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
    sup.say("stopping...")
    try:
        if control is not None:
            control.shutdown()
        if sup.planner is not None:
            sup.planner.stop()  # no switch starts after this
    finally:  # whatever failed above, no child outlives `up` and no secret stays on disk
        sup.stop_all()
        remove_run_file()
        shutil.rmtree(run_dir, ignore_errors=True)
