"""The router and etcd as supervised children (slots.Child); workers are plain
launcher.ServiceProcess objects (ready = their READY line)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from cluster.etcd_auth import EtcdAuth
from cluster.etcd_server import EtcdServer
from local_cluster.launcher import ServiceProcess


class RouterProcess(ServiceProcess):
    """`pdserve router`: ready once `url`/version answers (open whatever API keys are set)."""

    def __init__(self, args: list[str], log_path: Path, url: str) -> None:
        super().__init__(args, log_path)
        self.url = url
        self._answered = False

    def ready(self) -> bool:
        if not self._answered and self.alive():
            try:
                urllib.request.urlopen(f"{self.url}/version", timeout=1).close()
                self._answered = True
            except Exception:
                pass
        return self._answered


class EtcdChild:
    """etcd on fixed ports with a kept data directory, so a restart is the same etcd again
    (workers re-register on their own when it comes back), its users too (`auth`: created and
    enabled on the first start). Starting blocks until it serves."""

    def __init__(
        self,
        data_dir: Path,
        log_path: Path,
        client_port: int,
        peer_port: int,
        auth: EtcdAuth | None = None,
    ) -> None:
        self.server = EtcdServer(
            data_dir=data_dir,
            log_path=log_path,
            client_port=client_port,
            peer_port=peer_port,
            auth=auth,
        ).start()
        proc = self.server.proc
        assert proc is not None  # start() returned: etcd serves
        self.proc = proc
        self.pid = proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def ready(self) -> bool:
        return True

    def terminate(self) -> int:
        self.server.stop()
        return self.proc.returncode

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)
