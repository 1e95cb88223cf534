"""The cluster plane's authentication (cluster/grpc_security.py, cluster/grpc_auth.py) on a real
grpc.aio server built as a worker builds its own (`make_grpc_server`: the token check, then
the status interceptor; `add_port`), serving two `Worker` methods that count the calls
reaching them:
- with a cluster token, a call without it or with another one is UNAUTHENTICATED with a
  message, never reaches the service and is logged with the caller (never the token); the
  right token passes, on asyncio and blocking channels, unary and streaming;
- with mutual TLS (a throwaway CA made with the `openssl` CLI), a client without a
  certificate, or with one from another CA, or without TLS, is refused;
- bad configuration (empty or unreadable token file, a short or multi-line token, TLS half
  set) is refused at start by name, and `pdserve` exits 2 before loading anything."""

import asyncio
import logging
from pathlib import Path

import grpc
import pytest
from throwaway_pki import Pki, make_pki, openssl_available

from cluster.grpc_auth import add_port, aio_channel, channel
from cluster.grpc_security import OPEN, TOKEN_ENV, ClusterAuth, GrpcSecurity, resolve
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from worker_runtime.runtime import make_grpc_server

pytestmark = pytest.mark.timeout(60)

TOKEN = "cluster-token-0123456789abcdef"


class Servicer(pb_grpc.WorkerServicer):
    """Health (unary) and SubscribeKVEvents (server streaming: two batches); `reached` counts
    the calls that got past the interceptors."""

    def __init__(self) -> None:
        self.reached = 0

    async def Health(self, request, context):
        self.reached += 1
        return pb.HealthResponse(worker_id="w-1", role="decode")

    async def SubscribeKVEvents(self, request, context):
        self.reached += 1
        for seq in (1, 2):
            yield pb.KVEventBatch(stored=[bytes([seq])])


async def _serve(auth: ClusterAuth) -> tuple[grpc.aio.Server, str, Servicer]:
    rt = Servicer()
    server = make_grpc_server(auth)
    pb_grpc.add_WorkerServicer_to_server(rt, server)
    port = add_port(server, "127.0.0.1:0", auth)
    await server.start()
    return server, f"localhost:{port}", rt


async def _calls(ch: grpc.aio.Channel) -> tuple[str, list[int]]:
    """Health's worker id and the streamed batches' seqs."""
    stub = pb_grpc.WorkerStub(ch)
    health = await stub.Health(pb.HealthRequest(), timeout=10)
    seqs = [b.stored[0][0] async for b in stub.SubscribeKVEvents(pb.KVEventsRequest(), timeout=10)]
    return health.worker_id, seqs


def _blocking_health(address: str, auth: ClusterAuth) -> str:
    """Health over a blocking channel (`pdserve role`, the planner), off the server's loop."""
    with channel(address, auth) as ch:
        return pb_grpc.WorkerStub(ch).Health(pb.HealthRequest(), timeout=10).worker_id


async def _refused(ch: grpc.aio.Channel) -> list[grpc.aio.AioRpcError]:
    """Both calls, each expected to fail."""
    stub = pb_grpc.WorkerStub(ch)
    errors = []
    with pytest.raises(grpc.aio.AioRpcError) as unary:
        await stub.Health(pb.HealthRequest(), timeout=10)
    errors.append(unary.value)
    with pytest.raises(grpc.aio.AioRpcError) as stream:
        async for _ in stub.SubscribeKVEvents(pb.KVEventsRequest(), timeout=10):
            pass
    errors.append(stream.value)
    return errors


def test_a_token_server_refuses_calls_without_the_token_and_serves_the_right_one(caplog):
    async def main():
        server, address, rt = await _serve(ClusterAuth(token=TOKEN, source="test"))
        try:
            async with aio_channel(address, OPEN) as ch:
                missing = await _refused(ch)
            async with aio_channel(address, ClusterAuth(token="another-token-0123456789")) as ch:
                wrong = await _refused(ch)
            assert rt.reached == 0  # refused before any servicer ran
            async with aio_channel(address, ClusterAuth(token=TOKEN)) as ch:
                served = await _calls(ch)
            blocking = await asyncio.to_thread(_blocking_health, address, ClusterAuth(token=TOKEN))
            return missing, wrong, served, blocking
        finally:
            await server.stop(0)

    with caplog.at_level(logging.WARNING, logger="cluster.grpc_auth"):
        missing, wrong, served, blocking = asyncio.run(main())
    for errors, reason in ((missing, "no cluster token"), (wrong, "wrong cluster token")):
        for exc in errors:
            assert exc.code() is grpc.StatusCode.UNAUTHENTICATED
            assert exc.details().startswith(f"{reason}: this worker needs the cluster token")
            assert TOKEN_ENV in exc.details()
    assert served == ("w-1", [1, 2]) and blocking == "w-1"
    refusals = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(refusals) == 4
    assert all(m.startswith("refused /pdserve.v1.Worker/") and " from ipv" in m for m in refusals)
    assert not any(TOKEN in m or "another-token" in m for m in refusals)


def test_an_open_server_serves_plain_channels_as_before():
    async def main():
        server, address, _ = await _serve(OPEN)
        try:
            async with aio_channel(address, OPEN) as ch:
                return await _calls(ch)
        finally:
            await server.stop(0)

    assert asyncio.run(main()) == ("w-1", [1, 2])


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> tuple[Pki, Pki]:
    """The cluster's CA and certificate, and a stranger's from another CA."""
    if not openssl_available():
        pytest.skip(
            "no `openssl` command (and the `cryptography` package is not installed): "
            "cannot make test certificates"
        )
    tmp = tmp_path_factory.mktemp("pki")
    return make_pki(tmp / "cluster"), make_pki(tmp / "other", name="stranger")


def _tls(pki: Pki, token: str | None = None) -> ClusterAuth:
    security = GrpcSecurity(tls_cert=str(pki.cert), tls_key=str(pki.key), tls_ca=str(pki.ca))
    return ClusterAuth(token=token, tls=resolve(security, {}).tls)


def test_mutual_tls_refuses_clients_without_a_certificate_of_the_cluster_ca(pki):
    ours, stranger = pki

    async def refused(ch) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await pb_grpc.WorkerStub(ch).Health(pb.HealthRequest(), timeout=5)
        return exc.value.code()

    async def main():
        server, address, rt = await _serve(_tls(ours, TOKEN))
        try:
            async with aio_channel(address, _tls(ours, TOKEN)) as ch:
                served = await _calls(ch)
            blocking = await asyncio.to_thread(_blocking_health, address, _tls(ours, TOKEN))
            no_cert = grpc.ssl_channel_credentials(root_certificates=ours.ca.read_bytes())
            async with grpc.aio.secure_channel(address, no_cert) as ch:
                without_cert = await refused(ch)
            async with aio_channel(address, _tls(stranger, TOKEN)) as ch:
                other_ca = await refused(ch)
            async with aio_channel(address, ClusterAuth(token=TOKEN)) as ch:  # no TLS at all
                plain = await refused(ch)
            async with aio_channel(address, _tls(ours)) as ch:  # the certificate, no token
                (no_token, _) = await _refused(ch)
            return served, blocking, without_cert, other_ca, plain, no_token, rt.reached
        finally:
            await server.stop(0)

    served, blocking, without_cert, other_ca, plain, no_token, reached = asyncio.run(main())
    assert served == ("w-1", [1, 2]) and blocking == "w-1"
    assert without_cert is other_ca is plain is grpc.StatusCode.UNAVAILABLE  # no handshake
    assert no_token.code() is grpc.StatusCode.UNAUTHENTICATED
    assert reached == 3  # the two calls, and the blocking one


def test_the_tls_server_name_is_checked_instead_of_the_host_dialled(tmp_path):
    if not openssl_available():
        pytest.skip("no `openssl` command: cannot make test certificates")
    named = make_pki(tmp_path, name="named", hosts=("pdserve-worker",))  # no IP address in it
    files = dict(tls_cert=str(named.cert), tls_key=str(named.key), tls_ca=str(named.ca))

    async def health(address: str, auth: ClusterAuth) -> str | grpc.StatusCode:
        async with aio_channel(address, auth) as ch:
            try:
                return (
                    await pb_grpc.WorkerStub(ch).Health(pb.HealthRequest(), timeout=5)
                ).worker_id
            except grpc.aio.AioRpcError as exc:
                return exc.code()

    async def main():
        auth = resolve(GrpcSecurity(**files), {})
        server, address, _ = await _serve(auth)
        address = address.replace("localhost", "127.0.0.1")
        try:
            return (
                await health(address, auth),
                await health(
                    address, resolve(GrpcSecurity(**files, tls_server_name="pdserve-worker"), {})
                ),
            )
        finally:
            await server.stop(0)

    assert asyncio.run(main()) == (grpc.StatusCode.UNAVAILABLE, "w-1")


# ---- configuration -------------------------------------------------------------------------


def test_the_token_comes_from_its_file_else_the_environment(tmp_path):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")  # a Secret's or `echo`'s trailing newline is not part of it
    from_file = resolve(GrpcSecurity(cluster_token_file=str(f)), {TOKEN_ENV: "x" * 20})
    assert (from_file.token, from_file.source) == (TOKEN, f"--cluster-token-file {f}")
    from_env = resolve(GrpcSecurity(), {TOKEN_ENV: TOKEN})
    assert (from_env.token, from_env.source) == (TOKEN, TOKEN_ENV)
    assert resolve(GrpcSecurity(), {}) == OPEN and not OPEN.authenticated
    assert TOKEN not in repr(from_env) and TOKEN not in from_env.describe()


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "the file is empty"),
        ("\n", "the file is empty"),
        ("short\n", "the cluster token has 5 characters; use at least 16"),
        (TOKEN + "\n" + TOKEN + "\n", "the cluster token is one line"),
        ("has a space in it, 0123456789", "printable ASCII without spaces"),
    ],
)
def test_bad_token_files_are_refused_by_name(tmp_path, content, message):
    f = tmp_path / "token"
    f.write_text(content)
    with pytest.raises(ValueError, match=f"^--cluster-token-file {f}: .*{message}"):
        resolve(GrpcSecurity(cluster_token_file=str(f)), {})


def test_bad_security_settings_are_refused_by_name(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=f"--cluster-token-file {missing}: cannot read it"):
        resolve(GrpcSecurity(cluster_token_file=missing), {})
    with pytest.raises(ValueError, match=f"^{TOKEN_ENV}: the cluster token is empty"):
        resolve(GrpcSecurity(), {TOKEN_ENV: ""})
    with pytest.raises(
        ValueError, match="^--tls-cert without --tls-key, --tls-ca: mutual TLS needs all three"
    ):
        resolve(GrpcSecurity(tls_cert=missing), {})
    with pytest.raises(ValueError, match="^--tls-key, --tls-ca without --tls-cert"):
        resolve(GrpcSecurity(tls_key=missing, tls_ca=missing), {})
    with pytest.raises(ValueError, match="^--tls-server-name needs --tls-cert"):
        resolve(GrpcSecurity(tls_server_name="w"), {})
    with pytest.raises(ValueError, match=f"^--tls-cert {missing}: cannot read it"):
        resolve(GrpcSecurity(tls_cert=missing, tls_key=missing, tls_ca=missing), {})
    text = tmp_path / "text"
    text.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=f"^--tls-cert {text}: not a PEM file"):
        resolve(GrpcSecurity(tls_cert=str(text), tls_key=str(text), tls_ca=str(text)), {})


@pytest.mark.parametrize(
    "command", [["decode", "--etcd", "127.0.0.1:1"], ["router", "--etcd", "127.0.0.1:1"]]
)
def test_workers_and_the_router_exit_2_on_bad_security_before_loading_anything(
    command, tmp_path, capsys, monkeypatch
):
    from pdserve.cli import main

    empty = tmp_path / "token"
    empty.write_text("")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert main([*command, "--cluster-token-file", str(empty)]) == 2
    assert (
        f"pdserve {command[0]}: error: --cluster-token-file {empty}: the file is empty"
        in capsys.readouterr().err
    )
    assert main([*command, "--tls-cert", str(Path("c.pem"))]) == 2
    assert "--tls-cert without --tls-key, --tls-ca" in capsys.readouterr().err
