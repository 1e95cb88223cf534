"""A tensor-parallel group listens on loopback only: the rendezvous store (torch's TCPStore
server would listen on every interface) and the gloo groups' connections. Checked on two real
ranks, each in its own process, from the kernel's table of listening sockets."""

import os
import subprocess
import sys
import textwrap

from cluster.net import free_port

RANK = textwrap.dedent(
    """
    import os, sys, torch
    from engine.parallel.communicator import DistributedCommunicator

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    comm = DistributedCommunicator(rank, 2, port, 30.0, torch.device("cpu"))
    x = torch.ones(2)
    comm.all_reduce(x)
    assert x.tolist() == [2.0, 2.0]
    comm.broadcast_payload("step")  # the payload group is up too

    def inodes():
        out = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
        return out

    mine, listening = inodes(), []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in mine:  # LISTEN, one of ours
                    listening.append(cols[1])
    print("LISTENING", " ".join(listening), flush=True)
    import torch.distributed as dist
    dist.barrier()
    """
)


def _loopback(local: str) -> bool:
    """/proc/net/tcp{,6}'s hex address:port: 127.x.x.x or ::1 (or ::ffff:127.x.x.x)."""
    address = local.split(":")[0]
    if len(address) == 8:  # IPv4, little-endian bytes
        return address[-2:] == "7F"
    return address in ("00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def test_a_tensor_parallel_group_listens_on_loopback_only():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(ranks, outputs):
        assert p.returncode == 0, err[-2000:]
    listening = [a for out, _ in outputs for a in out.split("LISTENING", 1)[1].split()]
    assert len(listening) >= 2  # the store on rank 0, the gloo pairs
    assert all(_loopback(a) for a in listening), listening
