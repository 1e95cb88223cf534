"""Where a running `pdserve up` is found, and how its clients (`pdserve scale` / `status`,
benchmarks, tests) talk to its control server (control.py): the run file
`$PDSERVE_CACHE/run/current-cluster.json` (pid, url, etcd, cluster, control address and
token, logs, where etcd's read-only user's password is, the gRPC security files, the router's
API key file when there is one), readable by its user alone."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

from cluster.etcd_security import EtcdCredentials, EtcdSecurity
from cluster.grpc_security import ClusterAuth, GrpcSecurity, resolve

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


def cluster_auth(run: dict) -> ClusterAuth:
    """What a client of the `up` that wrote `run` presents to its workers' gRPC ports: the
    token file (and TLS files) that `up` gave them, else PDSERVE_CLUSTER_TOKEN."""
    return resolve(GrpcSecurity(**run.get("grpc_security", {})), os.environ)


def control_request(
    run: dict, path: str = "", body: dict | None = None, timeout: float = 5.0
) -> bytes:
    """GET (or, with `body`, POST as JSON) `path` on the control server of the `up` that
    wrote `run` (its run file), with that run's token."""
    headers = {"Authorization": f"Bearer {run['control_token']}"}
    data = None
    if body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    req = urllib.request.Request(
        run["control"] + path,
        data=data,
        headers=headers,
        method="POST" if body is not None else "GET",
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def etcd_credentials(run: dict) -> EtcdCredentials:
    """How the `up` that wrote `run` lets its readers into etcd (`pdserve status`, the chaos
    checks): its router's user (read only), resolved now."""
    return EtcdSecurity(**run.get("etcd_security", {})).resolve()
