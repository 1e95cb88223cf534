"""`pdserve up` stops every child and removes its run directory (the secrets in it) even
when its stdout is gone: the terminal closed, or the process reading its output died. Once a
failed "stopping..." write ended `up` with its workers, router and etcd still running."""

import time

from cluster.net import free_port
from local_cluster.children import EtcdChild
from local_cluster.config import UpConfig
from local_cluster.supervisor import Supervisor
from local_cluster.up import stop_cluster


class _ClosedStdout:
    """sys.stdout after its reader went away: every write fails as a broken pipe does."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_stdout_does_not_keep_children_alive(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "cluster-token").write_text("a-secret-token-0123456789\n")
    ports = (free_port(), free_port())
    sup = Supervisor(UpConfig(), f"127.0.0.1:{ports[0]}", tmp_path / "logs")
    (tmp_path / "logs").mkdir()
    sup.add_slot(
        "etcd",
        lambda: EtcdChild(run_dir / "etcd-data", tmp_path / "logs" / "etcd.log", *ports),
        name="etcd",
    )
    sup.start()
    deadline = time.monotonic() + 60
    while not ((child := sup.slots[0].child) is not None and child.alive()):
        assert time.monotonic() < deadline, "etcd did not start"
        time.sleep(0.1)
    try:
        with monkeypatch.context() as closed:
            closed.setattr("sys.stdout", _ClosedStdout())
            stop_cluster(sup, None, run_dir)
        assert not child.alive()
        assert not run_dir.exists()
    finally:
        if child.alive():  # the test failed: stop what it started
            child.terminate()
