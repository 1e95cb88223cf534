"""`pdserve up`'s control server: every request needs the token from the run file, the run
file is readable by its user alone, and a scale asks for a bounded number of workers."""

import json
import os
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cluster.etcd_security import EtcdSecurity
from cluster.grpc_security import GrpcSecurity
from local_cluster import control
from local_cluster.config import UpConfig
from local_cluster.control import MAX_SCALE_DELTA, serve_control
from local_cluster.run_file import control_request, current, run_file


class RecordingSupervisor:
    etcd = "127.0.0.1:1"
    config = UpConfig(cluster="c", grpc_security=GrpcSecurity(cluster_token_file="/run/t"))
    log_dir = Path("/nonexistent-logs")
    planner = None
    router_etcd = EtcdSecurity("pdserve-router", "/run/etcd-pdserve-router.password")

    def __init__(self) -> None:
        self.scaled: list[tuple[str, int]] = []

    def snapshot(self) -> dict:
        return {"pids": {}, "slots": []}

    def scale(self, role: str, delta: int) -> dict:
        self.scaled.append((role, delta))
        return self.snapshot()


@pytest.fixture
def served(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    sup = RecordingSupervisor()
    server = serve_control(sup, "http://127.0.0.1:8000")
    try:
        yield sup, current()
    finally:
        server.shutdown()
        control.remove_run_file()


def _status(run: dict, path: str = "", body: bytes | None = None, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    req = urllib.request.Request(
        run["control"] + path,
        data=body,
        headers=headers,
        method="POST" if body is not None else "GET",
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_run_file_is_private_and_requests_need_its_token(served):
    sup, run = served
    assert stat.S_IMODE(os.stat(run_file()).st_mode) == 0o600
    assert EtcdSecurity(**current()["etcd_security"]) == RecordingSupervisor.router_etcd
    assert len(run["control_token"]) >= 32
    assert run["grpc_security"]["cluster_token_file"] == "/run/t"  # where clients find it
    scale = json.dumps({"role": "decode", "delta": 1}).encode()
    for token in (None, "", "wrong", run["control_token"] + "x"):
        assert _status(run, token=token) == 401
        assert _status(run, "/metrics", token=token) == 401
        assert _status(run, "/scale", scale, token=token) == 401
    assert sup.scaled == []
    assert json.loads(control_request(run)) == {"pids": {}, "slots": []}
    assert control_request(run, "/metrics") == b""
    control_request(run, "/scale", {"role": "decode", "delta": 2})
    assert sup.scaled == [("decode", 2)]


def test_a_scale_is_bounded(served):
    sup, run = served
    for delta in (MAX_SCALE_DELTA + 1, -MAX_SCALE_DELTA - 1, 10**9):
        with pytest.raises(urllib.error.HTTPError) as exc:
            control_request(run, "/scale", {"role": "decode", "delta": delta})
        assert exc.value.code == 400
    big = json.dumps({"role": "decode", "delta": 1, "pad": "x" * 10_000}).encode()
    assert _status(run, "/scale", big, token=run["control_token"]) == 400
    assert sup.scaled == []
