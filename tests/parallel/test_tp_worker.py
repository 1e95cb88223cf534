"""What a tensor-parallel worker refuses at start, and what it no longer does: the prefill
role at tp 2 (KV moves between workers of any sizes, tests/kvtransfer/test_kv_tp_nixl.py;
tests/e2e/test_tp_disagg.py switches tp-2 workers to prefill with SetRole)."""

import argparse


def test_prefill_role_is_not_refused_at_tp2():
    from cluster.roles import Role
    from engine.config import EngineConfig
    from engine.flags import from_args
    from pdserve.worker_main import add_args, tensor_parallel_refusal
    from worker_runtime.args import WorkerConfig

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--etcd", "127.0.0.1:1", "-tp", "2"])
    config = from_args(WorkerConfig, args, role=Role.PREFILL)
    assert tensor_parallel_refusal(Role.PREFILL, config, EngineConfig.from_args(args)) is None


def test_host_core_sharing_refused_at_tp2(capsys):
    from cluster.roles import Role
    from pdserve.worker_main import add_args, run

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--etcd", "127.0.0.1:1", "-tp", "2", "--share-host-cores"])
    assert run(Role.DECODE, args) == 2
    assert "--share-host-cores" in capsys.readouterr().err
