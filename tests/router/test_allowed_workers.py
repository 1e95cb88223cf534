"""`--allowed-worker-cidrs`: a registration whose gRPC or metrics address lies outside the
allowed networks (or names a host) is ignored with one warning, gets no prompts, and the
dashboard never fetches its /metrics (blind SSRF); with a real etcd and an in-process router."""

import argparse
import ipaddress
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from router_fakes import MODEL_ID, FakeWorker
from router_harness import start_router, stop_router, wait_for

from cluster.net import free_port
from cluster.registration import WorkerInfo, make_client, worker_key
from router.placement.allowed_workers import ANY, LOOPBACK, AllowedWorkers, parse_network

ONLY_127_0_0_1 = (ipaddress.ip_network("127.0.0.1/32"),)


class _Recorder:
    """An HTTP server answering /metrics like a worker's, remembering every request."""

    def __init__(self, host: str) -> None:
        hits = self.hits = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hits.append(self.path)
                body = b'pdserve_kv_transfer_bytes_total{direction="sent"} 5\n'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((host, free_port(host)), Handler)
        self.address = f"{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_forged_registrations_outside_the_cidrs_get_no_work_and_no_metrics_fetch(
    etcd, bg, cluster_name, caplog
):
    inside, outside = _Recorder("127.0.0.1"), _Recorder("127.0.0.2")  # .2: still loopback here
    caplog.set_level(logging.WARNING, logger="router.placement.registry")

    def forged(worker_id: str, grpc: str, metrics: str) -> WorkerInfo:
        return WorkerInfo(
            worker_id, "decode", grpc, MODEL_ID, "fake-compat", 16, metrics_address=metrics
        )

    async def main():
        worker = await FakeWorker("decode", etcd.endpoint, cluster_name, "d1").start()
        router = await start_router(
            etcd.endpoint, cluster_name, allowed_worker_cidrs=ONLY_127_0_0_1
        )
        try:
            # What anyone who can write to an open etcd can do: put registrations by hand.
            async with make_client(etcd.endpoint) as client:
                for info in (
                    forged("evil-grpc", "10.9.8.7:50051", outside.address),
                    forged("evil-metrics", worker.address, outside.address),
                    forged("evil-name", "evil.example:50051", ""),
                    forged("ok-metrics", worker.address, inside.address),
                ):
                    await client.put(
                        worker_key(cluster_name, "decode", info.worker_id), info.to_json()
                    )
            registry = router.services.registry
            await wait_for(lambda: registry.get("ok-metrics") is not None)
            await wait_for(lambda: registry.get("d1") is not None)
            await wait_for(lambda: len(caplog.records) >= 3)
            assert sorted(w.info.worker_id for w in registry.all()) == ["d1", "ok-metrics"]
            async with httpx.AsyncClient() as http:
                data = (await http.get(router.url + "/dashboard/data", timeout=10)).json()
            assert {w["worker_id"] for w in data["workers"]} == {"d1", "ok-metrics"}
            return data
        finally:
            await stop_router(router)
            await worker.stop()

    try:
        data = bg.run(main(), timeout=60)
    finally:
        inside.close()
        outside.close()
    assert outside.hits == []  # the forged metrics address was never fetched
    assert inside.hits == ["/metrics"]  # the dashboard does fetch an accepted one
    assert {w["worker_id"]: w["kv_bytes"] for w in data["workers"]}["ok-metrics"] == 5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for worker_id, reason in [
        ("evil-grpc", "gRPC address 10.9.8.7:50051 is outside"),
        ("evil-metrics", f"metrics address {outside.address} is outside"),
        ("evil-name", "names a host, not an IP address"),
    ]:
        said = [w for w in warnings if f"ignoring worker {worker_id} " in w]
        assert len(said) == 1 and reason in said[0], warnings  # once, despite the re-listings


def test_allowed_workers_rules():
    def info(grpc: str, metrics: str = "") -> WorkerInfo:
        return WorkerInfo("w", "decode", grpc, "m", "c", 16, metrics_address=metrics)

    anything, loopback = AllowedWorkers(ANY), AllowedWorkers(LOOPBACK)
    assert anything.refusal(info("worker-0.svc:50051", "10.0.0.1:9")) is None
    assert loopback.refusal(info("127.0.0.5:1", "127.0.0.1:2")) is None
    assert loopback.refusal(info("[::1]:1")) is None
    assert loopback.refusal(info("[::ffff:127.0.0.1]:1")) is None  # v4-mapped
    assert "outside" in loopback.refusal(info("[::2]:1"))
    assert "outside" in loopback.refusal(info("127.0.0.1:1", "192.168.1.1:9"))
    assert "names a host" in loopback.refusal(info("localhost:1"))
    v4_only = AllowedWorkers((ipaddress.ip_network("0.0.0.0/0"),))  # not "any": names refused
    assert "names a host" in v4_only.refusal(info("worker-0:1"))
    assert parse_network("10.0.0.0/8") == ipaddress.ip_network("10.0.0.0/8")
    with pytest.raises(argparse.ArgumentTypeError, match="not a network in CIDR form"):
        parse_network("10.0.0.1/8")  # host bits set
    with pytest.raises(argparse.ArgumentTypeError, match="not a network in CIDR form"):
        parse_network("localhost")


def test_the_router_flag_parses_and_refuses_by_name(capsys):
    from pdserve.cli import build_parser
    from router.cli import config_from_args

    parse = lambda *a: config_from_args(build_parser().parse_args(["router", "--etcd", "e:1", *a]))  # noqa: E731
    assert parse().allowed_worker_cidrs == ANY
    assert parse("--allowed-worker-cidrs", "10.0.0.0/8", "fd00::/8").allowed_worker_cidrs == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("fd00::/8"),
    )
    with pytest.raises(SystemExit):
        parse("--allowed-worker-cidrs", "10.0.0.0/33")
    assert (
        "--allowed-worker-cidrs: '10.0.0.0/33' is not a network in CIDR form"
        in capsys.readouterr().err
    )
