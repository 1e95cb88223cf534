"""Test utility: two emulated hosts as Linux network namespaces joined by a veth pair.

`two_hosts()` creates `pd-<hex>-p` and `pd-<hex>-d` (loopback up in each), one veth pair with
a private /30 address on each end (these addresses exist only inside the two namespaces),
and removes both namespaces, by name, on exit, also when the body failed. Processes run in a
namespace through `ip netns exec` (which also mounts that namespace's /sys, where UCX lists
the network devices, and then execs the command: its PID is the process's own); `NetnsChild`
is such a process talking to the test over a Unix socket (a file path: reachable from every
network namespace, unlike an abstract or TCP socket). Children are stopped by PID.

Link impairments: `netem()` (delay, loss: needs a kernel with sch_netem), `rate_limit()`
(tbf) and `packet_loss()` (nftables), each removed on exit. Needs root and iproute2
(`skip_reason()` says why not).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().with_name("netns_child.py")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


def skip_reason() -> str | None:
    """Why namespace tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    name = f"pd-probe-{secrets.token_hex(3)}"
    probe = _ip("netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"`ip netns add` failed: {probe.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@dataclass(frozen=True)
class Host:
    """One end of the link: its namespace, veth device and address."""

    netns: str
    dev: str
    addr: str

    def exec_argv(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def ucx_env(self) -> dict[str, str]:
        """UCX over TCP on this host's veth only: no shared memory, no CMA, no loopback."""
        return {"UCX_NET_DEVICES": self.dev, "UCX_TLS": "tcp"}

    def link_bytes(self) -> tuple[int, int]:
        """(tx, rx) bytes counted by the kernel on this host's veth."""
        out = subprocess.run(
            self.exec_argv(
                "cat",
                f"/sys/class/net/{self.dev}/statistics/tx_bytes",
                f"/sys/class/net/{self.dev}/statistics/rx_bytes",
            ),
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.split()
        return int(out[0]), int(out[1])


@dataclass(frozen=True)
class TwoHosts:
    prefill: Host
    decode: Host


@contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """Namespaces P and D, veth P<->D with 10.<r>.<r>.1/30 (P) and .2/30 (D)."""
    tag = secrets.token_hex(3)
    octet2, octet3 = 64 + secrets.randbelow(64), secrets.randbelow(64) * 4
    p = Host(f"pd-{tag}-p", f"pd{tag}p", f"10.{octet2}.{octet3}.1")
    d = Host(f"pd-{tag}-d", f"pd{tag}d", f"10.{octet2}.{octet3}.2")
    created: list[str] = []
    try:
        for h in (p, d):
            _ip("netns", "add", h.netns)
            created.append(h.netns)
            _ip("-n", h.netns, "link", "set", "lo", "up")
        _ip(
            "link",
            "add",
            p.dev,
            "netns",
            p.netns,
            "type",
            "veth",
            "peer",
            "name",
            d.dev,
            "netns",
            d.netns,
        )
        for h in (p, d):
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/30", "dev", h.dev)
            _ip("-n", h.netns, "link", "set", h.dev, "up")
        yield TwoHosts(p, d)
    finally:
        for name in created:  # deleting a namespace destroys its end of the veth pair
            _ip("netns", "del", name, check=False)


def _tc(h: Host, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        h.exec_argv("tc", *args), capture_output=True, text=True, check=check, timeout=10
    )


def netem_unavailable(hosts: TwoHosts) -> str | None:
    """Why `netem()` cannot work here (e.g. a kernel built without sch_netem), or None."""
    h = hosts.prefill
    probe = _tc(h, "qdisc", "add", "dev", h.dev, "root", "netem", "delay", "1ms", check=False)
    if probe.returncode != 0:
        return f"tc netem: {probe.stderr.strip()} (kernel without sch_netem?)"
    _tc(h, "qdisc", "del", "dev", h.dev, "root", check=False)
    return None


@contextmanager
def _root_qdisc(hosts: TwoHosts, *qdisc: str) -> Iterator[None]:
    added: list[Host] = []
    try:
        for h in (hosts.prefill, hosts.decode):  # each end shapes its own egress
            _tc(h, "qdisc", "add", "dev", h.dev, "root", *qdisc)
            added.append(h)
        yield
    finally:
        for h in added:
            _tc(h, "qdisc", "del", "dev", h.dev, "root", check=False)


def netem(hosts: TwoHosts, spec: str):
    """`tc qdisc add dev <veth> root netem <spec>` on both ends, removed on exit."""
    return _root_qdisc(hosts, "netem", *spec.split())


def rate_limit(hosts: TwoHosts, rate: str):
    """A slow link: a token bucket (`tc ... tbf`) of `rate` (e.g. '4mbit') on both ends, with
    a queue deep enough that it delays rather than drops."""
    return _root_qdisc(hosts, "tbf", "rate", rate, "burst", "32kb", "latency", "10s")


@contextmanager
def packet_loss(hosts: TwoHosts, percent: int) -> Iterator[Callable[[], int]]:
    """Drop `percent`% of the packets each end sends on the veth: every (100 / percent)-th one,
    so a test that sends enough packets is sure to lose some (random drops of a short exchange
    may be none at all). An nftables table of our own in each namespace; needs no sch_netem.
    Yields a function counting the packets dropped so far."""
    added: list[Host] = []
    try:
        for h in (hosts.prefill, hosts.decode):
            nft = ["nft", "-f", "-"]
            rules = (
                f"table inet pdloss {{\n chain out {{\n type filter hook output priority 0;\n"
                f' oifname "{h.dev}" numgen inc mod {100 // percent} == 0 counter drop\n }}\n}}\n'
            )
            subprocess.run(
                h.exec_argv(*nft),
                input=rules,
                text=True,
                capture_output=True,
                check=True,
                timeout=10,
            )
            added.append(h)

        def dropped() -> int:
            return sum(
                int(n)
                for h in added
                for n in re.findall(
                    r"counter packets (\d+)",
                    subprocess.run(
                        h.exec_argv("nft", "list", "table", "inet", "pdloss"),
                        capture_output=True,
                        text=True,
                        check=True,
                        timeout=10,
                    ).stdout,
                )
            )

        yield dropped
    finally:
        for h in added:
            subprocess.run(
                h.exec_argv("nft", "delete", "table", "inet", "pdloss"),
                capture_output=True,
                timeout=10,
            )


class NetnsChild:
    """A Python process in `host`'s namespace running `target(conn, *args)` ("module:function";
    modules from the repository, tests/kvtransfer and tests/e2e), `conn` a multiprocessing
    Connection to this process. `call()` / `ready()` follow kv_peer.PeerProcess."""

    def __init__(
        self,
        host: Host,
        target: str,
        *args: Any,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.host = host
        self._dir = tempfile.mkdtemp(prefix="pd-netns-")  # 0700: only we can connect
        path = os.path.join(self._dir, "sock")
        self._log = open(log_path, "ab") if log_path else None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen(1)
            listener.settimeout(60)  # a child that dies before connecting
            self.proc = subprocess.Popen(
                host.exec_argv(sys.executable, str(CHILD), path, target),
                env={**os.environ, **(env or {})},
                stdin=subprocess.PIPE,
                stdout=self._log,
                stderr=self._log,
                cwd=str(REPO),
                start_new_session=True,
            )
            self.proc.stdin.write(repr(args).encode())
            self.proc.stdin.close()
            try:
                sock, _ = listener.accept()
            except OSError:
                self.kill()
                raise RuntimeError(f"child {target} in {host.netns} did not connect") from None
        sock.setblocking(True)
        self.conn = Connection(sock.detach())
        self.metadata: Any = None

    def ready(self, timeout_s: float = 60.0) -> NetnsChild:
        """The first message the child sends (a kv peer's metadata)."""
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"child in {self.host.netns} did not start")
        self.metadata = self.conn.recv()
        return self

    def call(self, *cmd: Any, timeout_s: float = 60.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"child in {self.host.netns} did not answer {cmd[0]!r}")
        reply = self.conn.recv()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def run(self, target: str, *args: Any, timeout_s: float = 120.0, **kwargs: Any) -> Any:
        """`target(*args, **kwargs)` in a `serve_calls` child; its exception is raised here."""
        return self.call("run", target, args, kwargs, timeout_s=timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        """Ask it to exit, then SIGKILL by PID if it has not within 10 s."""
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout_s=10)
            except (TimeoutError, EOFError, OSError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self.conn.close()
        if self._log:
            self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def serve_calls(conn: Any) -> None:
    """Child target: run ("run", "module:function", args, kwargs) calls (a coroutine function
    is run to its end) and send back their results; ("exit",) ends it."""
    import asyncio
    import importlib
    import inspect

    conn.send("ready")
    while True:
        cmd, *rest = conn.recv()
        if cmd == "exit":
            conn.send("bye")
            return
        try:
            target, args, kwargs = rest
            module, fn = target.split(":")
            reply = getattr(importlib.import_module(module), fn)(*args, **kwargs)
            if inspect.iscoroutine(reply):
                reply = asyncio.run(reply)
        except Exception as e:  # re-raised by NetnsChild.call
            reply = e if _picklable(e) else RuntimeError(f"{target}: {type(e).__name__}: {e}")
        conn.send(reply)


def _picklable(obj: Any) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(obj))
        return True
    except Exception:
        return False
