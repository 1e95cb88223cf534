"""How `pdserve scale` and `pdserve status` find and steer a running `pdserve up`: a loopback
HTTP control server (GET: live child PIDs by role and every slot's state and restarts, see
Supervisor.snapshot; GET /metrics: the planner's Prometheus metrics with `up --planner`, empty
without; POST /scale {"role", "delta"}: start workers, or drain and stop some) and the run file
that records its address."""
from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from local_cluster.supervisor import Supervisor

RUN_FILE = "current-cluster.json"


def run_file() -> Path:
    root = os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve"
    return Path(root) / "run" / RUN_FILE


def current() -> dict:
    """The run file of the running `pdserve up`: pid, url, etcd, cluster, control, logs."""
    try:
        return json.loads(run_file().read_text())
    except (OSError, ValueError):
        raise ValueError("no running `pdserve up` found (start one, or pass --etcd)") from None


def serve_control(supervisor: Supervisor, url: str) -> ThreadingHTTPServer:
    """Start the control server on a free loopback port and record it in the run file."""
    server = _control_server(supervisor)
    path = run_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "pid": os.getpid(), "url": url, "etcd": supervisor.etcd, "cluster": supervisor.config.cluster,
        "control": f"http://127.0.0.1:{server.server_address[1]}", "logs": str(supervisor.log_dir),
    }))
    return server


def remove_run_file() -> None:
    """Remove the run file if this process wrote it (another `up` may have replaced it)."""
    path = run_file()
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


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
            if self.path == "/metrics":
                planner = supervisor.planner
                data = planner.metrics_text() if planner is not None else b""
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
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
