"""A tensor-parallel worker's KV layout is shared with no peer (disaggregated transfer
between tensor-parallel workers is part 2), and `pdserve prefill -tp 2` is refused."""
import argparse

from kvtransfer import KVCompat
from kvtransfer.compat import check_compatible
from worker_runtime.runtime import tensor_parallel_compat


def test_tensor_parallel_layout_matches_no_peer():
    base = KVCompat("m", "float32", 16, 2, 1, 16)
    a, b = tensor_parallel_compat(base, 2), tensor_parallel_compat(base, 2)
    assert len({base.hash(), a.hash(), b.hash()}) == 3
    for theirs in (base, b):
        try:
            check_compatible(a, theirs)
        except Exception as exc:  # IncompatiblePeerError, naming the layout
            assert "tensor-parallel=2" in str(exc)
        else:
            raise AssertionError("a tensor-parallel pool was accepted")


def test_prefill_role_refused_at_tp2(capsys):
    from cluster.roles import Role
    from pdserve.worker_main import add_args, run

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--etcd", "127.0.0.1:1", "-tp", "2"])
    assert run(Role.PREFILL, args) == 2
    assert "KV transfer between tensor-parallel workers is not supported" in capsys.readouterr().err


def test_host_core_sharing_refused_at_tp2(capsys):
    from cluster.roles import Role
    from pdserve.worker_main import add_args, run

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--etcd", "127.0.0.1:1", "-tp", "2", "--share-host-cores"])
    assert run(Role.DECODE, args) == 2
    assert "--share-host-cores" in capsys.readouterr().err


def test_switch_to_prefill_refused_at_tp2():
    import asyncio

    import pytest

    from worker_runtime.admission import Admission
    from worker_runtime.grpc_errors import FailedPrecondition
    from worker_runtime.roles import WorkerRoles

    async def nothing(*_):
        pass

    roles = WorkerRoles(Admission("decode"), nothing, nothing, nothing, lambda *a: None,
                        drain_timeout_s=1.0, tensor_parallel_size=2)
    with pytest.raises(FailedPrecondition, match="prefill role is not supported at tensor_parallel_size 2"):
        asyncio.run(roles.set_role("prefill"))
