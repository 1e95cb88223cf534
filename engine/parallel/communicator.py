"""The collectives a tensor-parallel group runs, behind one small interface.

`Communicator` is the contract the model layers (through `ctx.comm`) and the step protocol
use; `DistributedCommunicator` implements it over torch.distributed: gloo on the CPU, NCCL
for the forward's collectives on CUDA (the step payloads always go over a gloo group: they are
host bytes). engine/parallel/fake.py is the in-process fake for single-process tests.

Timeouts: the forward's collectives are bounded by `timeout_s` (--distributed-timeout): a rank
that died or hangs makes the others' collective raise within it. Waiting for the next step
(`broadcast_payload` on a non-zero rank) is not bounded — an idle worker is not a failure; a
rank 0 that dies closes its connections (and its children get SIGKILL, rank_worker.py).
"""

from __future__ import annotations

import pickle
import socket
from datetime import timedelta
from typing import Any, Protocol

import torch

IDLE_TIMEOUT = timedelta(days=365)
"""How long a non-zero rank waits for rank 0's next step payload."""
LOOPBACK = "127.0.0.1"


def loopback_listener(port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:`port` only, for the rendezvous store to serve on."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen()
    return sock


def _gloo_options(timeout: timedelta) -> Any:
    """A gloo group whose connections listen and connect on loopback (by default gloo binds
    to the address the host name resolves to: in a container, its network's)."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    options._timeout = timeout
    return options


class Communicator(Protocol):
    """Collectives over the `size` ranks of one group; every rank calls each one in the same
    order (the forward is identical on every rank, step.py)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum `x` over the ranks, in place."""

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` (equal shapes), concatenated along `dim` in rank order."""

    def broadcast_payload(self, payload: Any = None) -> Any:
        """Rank 0 sends `payload` (any picklable object: a step's numpy arrays), every other
        rank gets it back (their argument is ignored)."""


class DistributedCommunicator:
    """torch.distributed process groups of one worker: the default group (gloo or NCCL) for
    the forward's collectives, a gloo group with a long timeout for step payloads."""

    def __init__(
        self, rank: int, size: int, port: int, timeout_s: float, device: torch.device
    ) -> None:
        """Joins the group (rank 0 hosts the rendezvous on 127.0.0.1:`port`); every rank must
        call this within `timeout_s`. Everything the group listens on is loopback: the
        rendezvous store (torch's own TCPStore server listens on every interface, so rank 0
        binds the socket itself) and the gloo groups' connections."""
        import torch.distributed as dist

        self.rank, self.size, self.device = rank, size, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        self._listener = loopback_listener(port) if rank == 0 else None
        store = dist.TCPStore(
            LOOPBACK,
            port,
            size,
            rank == 0,
            timeout,
            master_listen_fd=None if self._listener is None else self._listener.fileno(),
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=size,
            timeout=timeout,
            pg_options=_gloo_options(timeout) if backend == "gloo" else None,
        )
        self._payloads = dist.new_group(
            backend="gloo", timeout=IDLE_TIMEOUT, pg_options=_gloo_options(IDLE_TIMEOUT)
        )
        self.calls = 0  # collectives run by the forward (all-reduces and all-gathers)

    def all_reduce(self, x: torch.Tensor) -> None:
        import torch.distributed as dist

        self.calls += 1
        dist.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        import torch.distributed as dist

        self.calls += 1
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=dim)

    def broadcast_payload(self, payload: Any = None) -> Any:
        import torch.distributed as dist

        if self.rank == 0:
            data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
            length = torch.tensor([len(data)], dtype=torch.int64)
            dist.broadcast(length, 0, group=self._payloads)
            dist.broadcast(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self._payloads
            )
            return payload
        length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, 0, group=self._payloads)
        buf = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self._payloads)
        return pickle.loads(buf.numpy().tobytes())

    def gather_payload(self, payload: Any = None) -> list[Any] | None:
        """Every rank's `payload` (picklable), in rank order, on rank 0; None elsewhere."""
        import torch.distributed as dist

        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(payload, out, dst=0, group=self._payloads)
        return out

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
