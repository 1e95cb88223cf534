"""The worker's KV transfer self-test at start (worker_runtime/process.py transfer_selftest):
the production build runs it over its real NIXL agent (and skips it with
--no-kv-transfer-selftest); its result is logged, exported on /metrics and published in the
registration as `transfer_selftest` with exactly {gbps, memcpy_gbps, ratio, path}; a slow path
is a warning; a failed test is logged and published as 'failed: ...' and the worker goes on."""

import argparse
import json
import logging
from unittest import mock

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.grpc_security import OPEN
from cluster.registration import TransferSelftest, WorkerInfo
from engine.flags import add_flags, from_args
from kvtransfer import FakeFabric, FakeTransferBackend, KVTransferConfig
from kvtransfer.selftest import LOW_RATIO, SelftestResult
from worker_runtime.args import WorkerConfig
from worker_runtime.metrics import WorkerMetrics
from worker_runtime.process import transfer_selftest

pytestmark = pytest.mark.timeout(300)

GAUGES = ("gbps", "memcpy_gbps", "ratio")


def _engine_config(model_dir):
    from engine.config import EngineConfig

    return EngineConfig(
        model=str(model_dir), num_layers=2, dtype="float32", kv_cache_memory=8 << 20
    )


@pytest.fixture(scope="module")
def engine(model_dir):
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(_engine_config(model_dir))
    yield engine
    engine.close()


@pytest.fixture
def runtime(engine):
    """A worker runtime over the fake backend, with real /metrics."""
    from worker_runtime.runtime import WorkerRuntime

    fabric = FakeFabric()
    kv = FakeTransferBackend(fabric, KVTransferConfig(agent_name="w"))
    rt = WorkerRuntime(
        WorkerConfig(role="decode", etcd="unused:0", worker_id="decode-selftest-1"),
        engine,
        kv,
        lambda info: mock.AsyncMock(),
        auth=OPEN,
        metrics=WorkerMetrics("decode", kv, "m"),
    )
    rt.fabric = fabric
    yield rt
    rt.pool.deregister()  # the module's engine is registered again by the next runtime
    kv.close()


def _gauges(rt) -> dict[str, float]:
    text = generate_latest(rt.metrics.registry).decode()
    return {
        f.name.removeprefix("pdserve_kv_transfer_selftest_"): f.samples[0].value
        for f in text_string_to_metric_families(text)
        if f.name.startswith("pdserve_kv_transfer_selftest_")
    }


def _published(rt) -> dict:
    return json.loads(rt.info().to_json())


def test_the_result_is_logged_exported_and_published(runtime, caplog):
    assert "transfer_selftest" not in _published(runtime)  # not run yet: absent
    assert _gauges(runtime) == dict.fromkeys(GAUGES, 0.0)
    with caplog.at_level(logging.INFO, logger="worker_runtime.process"):
        result = transfer_selftest(runtime, lambda cfg: FakeTransferBackend(runtime.fabric, cfg))
    assert result.ok and result.gbps > 0, result
    [record] = [r for r in caplog.records if "KV transfer self-test" in r.getMessage()]
    assert record.getMessage().startswith(result.line()) and "fake" in record.getMessage()
    doc = _published(runtime)["transfer_selftest"]
    assert doc == {
        "gbps": result.gbps,
        "memcpy_gbps": result.memcpy_gbps,
        "ratio": result.ratio,
        "path": result.path,
    }
    runtime.grpc_address = runtime.metrics_address = "127.0.0.1:1"  # as once serving
    info = WorkerInfo.from_json(runtime.info().to_json())
    assert info.transfer_selftest == TransferSelftest(
        result.gbps, result.memcpy_gbps, result.ratio, result.path
    )
    assert _gauges(runtime) == {n: getattr(result, n) for n in GAUGES}
    assert set(runtime.fabric.agents) == {"w"} and runtime.kv.peers() == []


def test_a_failed_self_test_is_logged_and_published_and_the_worker_goes_on(runtime, caplog):
    def broken(cfg):
        raise RuntimeError("no UCX here")

    with caplog.at_level(logging.INFO, logger="worker_runtime.process"):
        result = transfer_selftest(runtime, broken)  # returns: the start goes on
    assert not result.ok
    [record] = [r for r in caplog.records if "KV transfer self-test" in r.getMessage()]
    assert record.levelno == logging.ERROR
    assert "KV transfer self-test failed: RuntimeError: no UCX here" in record.getMessage()
    assert _published(runtime)["transfer_selftest"] == {
        "gbps": 0.0,
        "memcpy_gbps": 0.0,
        "ratio": 0.0,
        "path": "failed: RuntimeError: no UCX here",
    }
    assert _gauges(runtime) == dict.fromkeys(GAUGES, 0.0)
    assert runtime.own_metadata()  # the worker's own agent is as it was


def test_a_slow_path_is_a_loud_warning(runtime, caplog):
    slow = SelftestResult(
        True, 1.5, 15.0, 0.1, "nixl/UCX DRAM UCX_NET_DEVICES=lo UCX_TLS=tcp", 1 << 22, 0.2
    )
    assert slow.low and slow.ratio < LOW_RATIO
    with (
        mock.patch("kvtransfer.selftest.run_selftest", return_value=slow),
        caplog.at_level(logging.INFO, logger="worker_runtime.process"),
    ):
        transfer_selftest(runtime, lambda cfg: None)
    [record] = [r for r in caplog.records if "KV transfer self-test" in r.getMessage()]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert message.startswith(slow.line()) and "BELOW 0.3x MEMCPY" in message
    assert "UCX_NET_DEVICES" in message and "UCX_TLS" in message


def test_the_flag_turns_it_off():
    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerConfig)
    on = from_args(WorkerConfig, parser.parse_args(["--etcd", "e:1"]), role="decode")
    off = from_args(
        WorkerConfig,
        parser.parse_args(["--etcd", "e:1", "--no-kv-transfer-selftest"]),
        role="decode",
    )
    assert on.kv_transfer_selftest and not off.kv_transfer_selftest
    assert "--no-kv-transfer-selftest" in parser.format_help()


@pytest.mark.parametrize("enabled", [True, False])
def test_the_production_build_measures_its_nixl_agent(model_dir, enabled):
    from worker_runtime.process import build_runtime

    threads = torch.get_num_threads()
    config = WorkerConfig(
        role="prefill", etcd="unused:0", num_threads=threads, kv_transfer_selftest=enabled
    )
    rt = build_runtime(config, _engine_config(model_dir), OPEN)
    try:
        published = _published(rt).get("transfer_selftest")
        if not enabled:
            assert published is None and _gauges(rt) == dict.fromkeys(GAUGES, 0.0)
            return
        assert published["gbps"] > 0 and published["memcpy_gbps"] > 0, published
        assert published["path"].startswith("nixl/UCX DRAM writes over cma/memory (UCX_NET_")
        assert _gauges(rt)["gbps"] == published["gbps"]
        assert rt.kv.peers() == [] and rt.kv.transport._remote == {}
    finally:
        rt.kv.close()
        rt.engine.close()
        torch.set_num_threads(threads)
