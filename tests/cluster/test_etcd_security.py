"""etcd with users and TLS (cluster/etcd_auth.py, etcd_security.py, etcd_client.py), against
real etcd processes: an etcd started with auth refuses anonymous clients, its worker user
registers (only under the cluster's prefix), its router user reads and watches but cannot
write, a restart on the same data keeps the users; TLS with a throwaway CA (openssl); and the
configuration errors, each naming its flag."""

import asyncio
import os
import stat
from dataclasses import replace

import pytest
from throwaway_pki import etcd_tls, openssl_available

from cluster.etcd_auth import WORKER_USER, etcd_users
from cluster.etcd_security import PASSWORD_ENV, EtcdCredentials, EtcdSecurity, EtcdTls
from cluster.etcd_server import EtcdServer
from cluster.registration import Registrar, WorkerInfo, list_workers, make_client, worker_key
from engine.checks import FieldError

CLUSTER = "sec"


def _info() -> WorkerInfo:
    return WorkerInfo("d1", "decode", "127.0.0.1:5", "m", "c", 16)


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """An etcd started as `pdserve up` starts its own: root, worker and router users."""
    users = etcd_users(CLUSTER, tmp_path_factory.mktemp("secrets"))
    with EtcdServer(auth=users.auth) as etcd:
        yield etcd, users


def test_password_files_are_0600_and_hold_no_one_elses_password(secured):
    _, users = secured
    for security in (users.root, users.worker, users.router):
        mode = stat.S_IMODE(os.stat(security.etcd_password_file).st_mode)
        assert mode == 0o600, oct(mode)
    assert (
        len({open(s.etcd_password_file).read() for s in (users.root, users.worker, users.router)})
        == 3
    )


def test_an_authenticated_etcd_refuses_anonymous_and_wrong_password_clients(secured):
    etcd, users = secured
    prefix = f"/pdserve/{CLUSTER}/".encode()

    async def main():
        async with make_client(etcd.endpoint) as anonymous:
            with pytest.raises(Exception, match="user name is empty"):
                await anonymous.get_prefix(prefix)
            with pytest.raises(Exception, match="user name is empty"):
                await anonymous.put(worker_key(CLUSTER, "decode", "forged"), _info().to_json())
        wrong = EtcdCredentials(WORKER_USER, "not-the-password")
        with pytest.raises(Exception, match="authentication failed"):
            async with make_client(etcd.endpoint, wrong) as client:
                await client.get_prefix(prefix)

    asyncio.run(main())


def test_the_worker_user_registers_and_the_router_user_only_reads(secured):
    etcd, users = secured
    worker, router = users.worker.resolve({}), users.router.resolve({})

    async def main():
        registrar = Registrar(etcd.endpoint, CLUSTER, _info, ttl_s=2, credentials=worker)
        await registrar.start()
        try:
            async with make_client(etcd.endpoint, router) as client:
                assert [w.worker_id for w in await list_workers(client, CLUSTER)] == ["d1"]
                with pytest.raises(Exception, match="permission denied"):
                    await client.put(worker_key(CLUSTER, "decode", "forged"), _info().to_json())
            async with make_client(etcd.endpoint, worker) as client:
                with pytest.raises(Exception, match="permission denied"):  # another cluster
                    await client.put(worker_key("other", "decode", "x"), _info().to_json())
        finally:
            await registrar.deregister()
        async with make_client(etcd.endpoint, router) as client:
            assert await list_workers(client, CLUSTER) == []

    asyncio.run(main())


def test_a_restart_on_the_same_data_keeps_the_users(tmp_path):
    users = etcd_users(CLUSTER, tmp_path)
    data = tmp_path / "data"
    first = EtcdServer(data_dir=data, auth=users.auth).start()
    ports = first.client_port, first.peer_port
    first.stop()
    with EtcdServer(
        data_dir=data, client_port=ports[0], peer_port=ports[1], auth=users.auth
    ) as etcd:

        async def main():
            async with make_client(etcd.endpoint, users.router.resolve({})) as client:
                assert await list_workers(client, CLUSTER) == []
            async with make_client(etcd.endpoint) as anonymous:
                with pytest.raises(Exception, match="user name is empty"):
                    await anonymous.get_prefix(b"/")

        asyncio.run(main())


# ---- TLS ----------------------------------------------------------------------------------


@pytest.mark.skipif(not openssl_available(), reason="no openssl CLI to make a throwaway CA")
def test_tls_with_client_certificates_and_a_user(tmp_path):
    tls = etcd_tls(tmp_path)
    users = etcd_users(CLUSTER, tmp_path)
    with EtcdServer(auth=users.auth, tls=tls) as etcd:
        security = replace(
            users.worker, etcd_ca=str(tls.ca), etcd_cert=str(tls.cert), etcd_key=str(tls.key)
        )
        credentials = security.resolve({})
        no_cert = replace(security, etcd_cert=None, etcd_key=None).resolve({})

        async def main():
            registrar = Registrar(etcd.endpoint, CLUSTER, _info, credentials=credentials)
            await registrar.start()
            async with make_client(etcd.endpoint, credentials) as client:
                assert [w.worker_id for w in await list_workers(client, CLUSTER)] == ["d1"]
            await registrar.deregister()
            for refused in (users.worker.resolve({}), no_cert):  # plain gRPC; no client cert
                with pytest.raises(Exception):
                    async with make_client(etcd.endpoint, refused, timeout=2) as client:
                        await client.get_prefix(b"/pdserve/")

        asyncio.run(main())


# ---- configuration ------------------------------------------------------------------------


def test_configuration_errors_name_the_flag(tmp_path):
    password = tmp_path / "pw"
    password.write_text("s3cret\nignored\n")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    blank_first = tmp_path / "blank-first"
    blank_first.write_text("\npassword\n")
    assert EtcdSecurity("u", str(password)).resolve({}) == EtcdCredentials("u", "s3cret")
    assert EtcdSecurity("u").resolve({PASSWORD_ENV: "env"}) == EtcdCredentials("u", "env")
    # a variable from a Kubernetes Secret keeps its file's newline: not part of the password
    assert EtcdSecurity("u").resolve({PASSWORD_ENV: "env\n"}) == EtcdCredentials("u", "env")
    assert EtcdSecurity().resolve({}) == EtcdCredentials()
    assert "s3cret" not in repr(EtcdSecurity("u", str(password)).resolve({}))
    for security, environ, message in [
        (EtcdSecurity("u"), {}, "--etcd-user u needs its password"),
        (EtcdSecurity(), {PASSWORD_ENV: "x"}, f"{PASSWORD_ENV} is set but --etcd-user is not"),
        (EtcdSecurity("u", str(blank_first)), {}, "the first line is empty"),
        (EtcdSecurity("u", str(empty)), {}, "--etcd-password-file .*: the file is empty"),
        (EtcdSecurity("u", str(tmp_path / "missing")), {}, "--etcd-password-file .*cannot read"),
        (EtcdSecurity(etcd_ca=str(empty)), {}, "--etcd-ca .*: the file is empty"),
    ]:
        with pytest.raises(ValueError, match=message):
            security.resolve(environ)
    for kwargs, field in [
        (dict(etcd_password_file="p"), "etcd_password_file"),
        (dict(etcd_cert="c"), "etcd_cert"),
        (dict(etcd_key="k"), "etcd_key"),
        (dict(etcd_cert="c", etcd_key="k"), "etcd_cert"),
        (dict(etcd_user=" "), "etcd_user"),
    ]:
        with pytest.raises(FieldError) as err:
            EtcdSecurity(**kwargs)
        assert err.value.field == field


def test_the_default_etcd_server_stays_open():
    """EtcdServer() as the other tests use it: no users, anyone on loopback may write."""
    with EtcdServer() as etcd:

        async def main():
            async with make_client(etcd.endpoint) as client:
                await client.put(b"/pdserve/x", b"1")
                assert (await client.get(b"/pdserve/x")).value == b"1"

        asyncio.run(main())


# ---- an https:// endpoint is TLS, with or without --etcd-ca --------------------------------


def test_an_https_endpoint_without_a_ca_is_tls_against_the_system_roots():
    from cluster.etcd_client import SYSTEM_ROOTS, _tls_client_class

    client = make_client("https://etcd.example:2379")
    assert isinstance(client, _tls_client_class()) and SYSTEM_ROOTS.ca is None
    assert not isinstance(make_client("http://etcd.example:2379"), _tls_client_class())


def test_an_https_endpoint_never_talks_plaintext_to_a_plain_etcd():
    """Before: the https:// scheme was dropped and the client spoke plain gRPC (a password
    and every registration in the clear). Now the TLS handshake fails."""
    with EtcdServer() as etcd:

        async def main():
            async with make_client(f"http://{etcd.endpoint}") as client:
                await client.get_prefix(b"/pdserve/")  # plain works where plain was asked
            with pytest.raises(Exception):
                async with make_client(f"https://{etcd.endpoint}", timeout=2) as client:
                    await client.get_prefix(b"/pdserve/")

        asyncio.run(main())


@pytest.mark.skipif(not openssl_available(), reason="no openssl CLI to make a throwaway CA")
def test_an_https_endpoint_without_a_ca_checks_the_certificate(tmp_path):
    """A certificate from a CA the system does not trust is refused (--etcd-ca names it)."""
    tls = etcd_tls(tmp_path)
    with EtcdServer(tls=tls) as etcd:

        async def main():
            own = EtcdTls(None, tls.cert.read_bytes(), tls.key.read_bytes())  # no CA given
            with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
                async with make_client(
                    f"https://{etcd.endpoint}", EtcdCredentials(tls=own), timeout=2
                ) as client:
                    await client.get_prefix(b"/pdserve/")
            trusted = EtcdSecurity(
                etcd_ca=str(tls.ca), etcd_cert=str(tls.cert), etcd_key=str(tls.key)
            ).resolve({})
            async with make_client(f"https://{etcd.endpoint}", trusted) as client:
                await client.get_prefix(b"/pdserve/")

        asyncio.run(main())
