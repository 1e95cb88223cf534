"""How `pdserve scale` and `pdserve status` find and steer a running `pdserve up`: a loopback
HTTP control server (GET: live child PIDs by role and every slot's state and restarts, see
Supervisor.snapshot; GET /metrics: the planner's Prometheus metrics with `up --planner`, empty
without; POST /scale {"role", "delta"}: start workers, or drain and stop some) and the run file
that records its address (read by the clients through run_file.py).

Every request carries `Authorization: Bearer <token>`: a token made for this `up`, kept in
the run file, which only its user can read (0600): another local user — or a web page
posting to loopback — cannot scale or read the cluster (401). A scale asks for at most
`MAX_SCALE_DELTA` workers at a time; bodies are at most `MAX_BODY_BYTES`."""

from __future__ import annotations

import dataclasses
import hmac
import json
import os
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from local_cluster.run_file import run_file

if TYPE_CHECKING:
    from local_cluster.supervisor import Supervisor

MAX_SCALE_DELTA = 64
"""Most workers one `pdserve scale` may add or remove."""
MAX_BODY_BYTES = 4096


def serve_control(supervisor: Supervisor, url: str) -> ThreadingHTTPServer:
    """Start the control server on a free loopback port and record it, with its token, in
    the run file (created 0600: the token is the key to the cluster)."""
    token = secrets.token_urlsafe(32)
    server = _control_server(supervisor, token)
    path = run_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = json.dumps(
        {
            "pid": os.getpid(),
            "url": url,
            "etcd": supervisor.etcd,
            "cluster": supervisor.config.cluster,
            "control": f"http://127.0.0.1:{server.server_address[1]}",
            "control_token": token,
            "logs": str(supervisor.log_dir),
            "etcd_security": dataclasses.asdict(supervisor.router_etcd),  # paths, no password
            "grpc_security": dataclasses.asdict(supervisor.config.grpc_security),
            "api_key_file": supervisor.config.api_key_file,  # a path, never the key
        }
    )
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(doc)
    os.replace(tmp, path)  # never a moment with the token in a readable file
    return server


def remove_run_file() -> None:
    """Remove the run file if this process wrote it (another `up` may have replaced it)."""
    path = run_file()
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def _control_server(supervisor: Supervisor, token: str) -> ThreadingHTTPServer:
    expected = f"Bearer {token}".encode()

    class Handler(BaseHTTPRequestHandler):
        def _authorized(self) -> bool:
            given = (self.headers.get("Authorization") or "").encode("latin-1", "replace")
            if hmac.compare_digest(given, expected):
                return True
            self._reply(401, {"error": "the control token (in the run file) is required"})
            return False

        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            if not self._authorized():
                return
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
            if not self._authorized():
                return
            try:
                length = int(self.headers.get("Content-Length", 0))
                if not 0 <= length <= MAX_BODY_BYTES:
                    raise ValueError(f"body of {length} bytes: at most {MAX_BODY_BYTES}")
                body = json.loads(self.rfile.read(length))
                delta = int(body["delta"])
                if not -MAX_SCALE_DELTA <= delta <= MAX_SCALE_DELTA:
                    raise ValueError(f"delta must be within +-{MAX_SCALE_DELTA}, got {delta}")
                self._reply(200, supervisor.scale(body["role"], delta))
            except (ValueError, KeyError, TypeError, RuntimeError) as exc:
                self._reply(400, {"error": str(exc)})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
