"""`pdserve up --api-key-file` end to end with the official openai client (the key in a
file, never on a command line; a request without it is refused; its etcd refuses anonymous
clients, its password files are 0600; the workers' gRPC ports need the cluster token `up`
made, in a 0600 file, never on a command line): concurrent streaming chats,
scale-out and scale-in under load with zero failed requests, a decode worker SIGKILLed under
load (replaced: the pool is restored), the router SIGKILLed (back on the same port), and
nothing left running after SIGTERM."""

import asyncio
import glob
import os
import signal
import stat
import time
import urllib.request

import grpc
import openai
import pytest
from up_cluster import Load, Up, alive, chat

from cluster.grpc_auth import aio_channel
from cluster.grpc_security import OPEN, ClusterAuth
from local_cluster.run_file import cluster_auth, etcd_credentials
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
KEY = "up-test-key-3f9c2a"


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _etcd_is_closed(up) -> None:
    """up's etcd has auth on: an anonymous client cannot read the cluster's prefix; the
    router's user can (`up.workers()` reads with it, as `pdserve status` does) but cannot
    write; every password file is 0600 and no password is on a command line."""
    from cluster.registration import make_client, worker_key

    security = up.run["etcd_security"]
    password_file = security["etcd_password_file"]
    assert stat.S_IMODE(os.stat(password_file).st_mode) == 0o600
    for path in glob.glob(os.path.join(os.path.dirname(password_file), "etcd-*.password")):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        password = open(path).read().strip()
        assert not any(
            password in " ".join(_cmdline(p)) for ps in up.children().values() for p in ps
        )
    assert len(glob.glob(os.path.join(os.path.dirname(password_file), "etcd-*.password"))) == 3
    assert up.workers()  # the router's user reads the registrations

    async def anonymous():
        prefix = f"/pdserve/{up.run['cluster']}/".encode()
        async with make_client(up.run["etcd"]) as client:
            with pytest.raises(Exception, match="user name is empty"):
                await client.get_prefix(prefix)
        async with make_client(up.run["etcd"], etcd_credentials(up.run)) as client:
            with pytest.raises(Exception, match="permission denied"):
                await client.put(worker_key(up.run["cluster"], "decode", "forged"), b"{}")

    asyncio.run(anonymous())


async def _direct_generate(address: str, auth: ClusterAuth) -> grpc.StatusCode:
    """A one-token Generate straight to a decode worker (bypassing the router)."""
    req = pb.GenerateRequest(
        request_id="direct",
        prompt_token_ids=[1, 2, 3],
        sampling=pb.SamplingParams(temperature=0, max_tokens=1),
    )
    async with aio_channel(address, auth) as ch:
        try:
            async for _ in pb_grpc.DecodeWorkerStub(ch).Generate(req, timeout=60):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_up_serves_scales_survives_a_kill_and_leaves_nothing(tmp_path):
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    up = Up(tmp_path, "--prefill", "1", "--decode", "1", "--api-key-file", str(key_file))
    pids = set()
    token_file = ""
    try:

        async def concurrent(api_key: str = KEY):
            client = openai.AsyncOpenAI(base_url=up.url + "/v1", api_key=api_key, max_retries=0)
            return await asyncio.gather(*[chat(client, i) for i in range(6)])

        assert all(isinstance(t, str) and t for t in asyncio.run(concurrent()))
        with pytest.raises(openai.AuthenticationError):
            asyncio.run(concurrent("not-the-key"))
        assert not any(KEY in " ".join(_cmdline(p)) for ps in up.children().values() for p in ps)
        # The workers' gRPC ports need the cluster token `up` made (0600, named in the run
        # file); it is on no command line either.
        token_file = up.run["grpc_security"]["cluster_token_file"]
        assert os.stat(token_file).st_mode & 0o777 == 0o600
        auth = cluster_auth(up.run)
        assert not any(
            auth.token in " ".join(_cmdline(p)) for ps in up.children().values() for p in ps
        )
        decode = next(w for w in up.workers() if w.role == "decode")
        assert (
            asyncio.run(_direct_generate(decode.grpc_address, OPEN))
            is grpc.StatusCode.UNAUTHENTICATED
        )
        wrong = ClusterAuth(token="not-the-cluster-token-0123456789")
        assert (
            asyncio.run(_direct_generate(decode.grpc_address, wrong))
            is grpc.StatusCode.UNAUTHENTICATED
        )
        assert asyncio.run(_direct_generate(decode.grpc_address, auth)) is grpc.StatusCode.OK
        pids |= {p for ps in up.children().values() for p in ps}
        assert {"prefill", "decode", "router", "etcd"} <= {k for k, v in up.children().items() if v}
        _etcd_is_closed(up)

        # Scale out under load: the new decode worker starts receiving requests.
        load = Load(up.url, api_key=KEY)
        time.sleep(2)
        up.cli("scale", "decode", "+1")
        pids |= {p for ps in up.children().values() for p in ps}
        new = max(up.workers(), key=lambda w: w.worker_id if w.role == "decode" else "")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            metrics = (
                urllib.request.urlopen(f"http://{new.metrics_address}/metrics", timeout=5)
                .read()
                .decode()
            )
            served = [
                line
                for line in metrics.splitlines()
                if line.startswith("pdserve_worker_generation_tokens_total")
            ]
            if served and float(served[0].split()[-1]) > 0:
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the added decode worker never received a request")

        # Scale in under load: the drained worker finishes its requests; nothing fails.
        up.cli("scale", "decode", "-1")
        deadline = time.monotonic() + 60  # the load runs on until the drained worker is gone
        while len([w for w in up.workers() if w.role == "decode"]) > 1:
            assert time.monotonic() < deadline, "the drained decode worker never deregistered"
            time.sleep(0.5)
        time.sleep(1)
        load.stop()
        assert load.failed == 0, load.errors[:3]
        assert load.ok > 0
        assert len([w for w in up.workers() if w.role == "decode"]) == 1

        # SIGKILL a decode worker under load: nothing fails (the router migrates what it held
        # to the other decode worker), and the supervisor restarts the slot: a new decode
        # worker registers and serves.
        up.cli("scale", "decode", "+1")
        pids |= {p for ps in up.children().values() for p in ps}
        load = Load(up.url, api_key=KEY)
        time.sleep(3)
        before = {w.worker_id for w in up.workers()}
        victim = up.children()["decode"][-1]
        name = next(n for n, s in up.slots().items() if s["pid"] == victim)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        slot = up.wait_slot(name, "ready", restarts=1)
        restored_s = time.monotonic() - killed_at
        print(f"decode pool restored {restored_s:.1f}s after SIGKILL")
        assert slot["last_exit"] == -9 and slot["pid"] != victim
        pids.add(slot["pid"])
        new = [w for w in up.workers() if w.role == "decode" and w.worker_id not in before]
        assert len(new) == 1 and not new[0].draining
        time.sleep(3)
        load.stop()
        assert load.failed == 0, load.errors[:5]
        assert load.ok > 0
        assert asyncio.run(concurrent())
        status = up.cli("status")
        assert any(
            line.split()[:2] == [name, "decode"] and line.split()[3:6] == ["ready", "1", "-9"]
            for line in status.splitlines()
        ), status

        # SIGKILL the router: it comes back on the same port; clients keep their URL.
        router = up.children()["router"][0]
        os.kill(router, signal.SIGKILL)
        slot = up.wait_slot("router", "ready", restarts=1)
        pids.add(slot["pid"])
        assert asyncio.run(concurrent())
    finally:
        code = up.stop()
    assert code == 0, "".join(up.output[-30:])
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)], "pdserve up left processes behind"
    assert not (tmp_path / "cache" / "run" / "current-cluster.json").exists()
    assert token_file and not os.path.exists(token_file)  # went with `up`'s run directory
