"""`pdserve etcd-users` (pdserve/etcd_users_cli.py, cluster/etcd_users_config.py,
etcd_auth.set_up_auth) against real etcd processes: an open etcd gets the users `pdserve up`
gives its own and refuses anonymous clients after; the worker password registers, the router
password reads but cannot write; a second run changes nothing, a changed password or a stray
permission is set right; a wrong root password on an authenticated etcd stops it (exit 1)
with nothing changed; TLS; and passwords can only come from files or variables."""

import argparse
import asyncio

import pytest
from throwaway_pki import etcd_tls, openssl_available

from cluster.etcd_auth import ROUTER_USER, WORKER_USER
from cluster.etcd_security import PASSWORD_ENV, EtcdCredentials, EtcdSecurity
from cluster.etcd_server import EtcdServer
from cluster.etcd_users_config import (
    ROOT_PASSWORD_ENV,
    ROUTER_PASSWORD_ENV,
    WORKER_PASSWORD_ENV,
    EtcdUsersConfig,
)
from cluster.registration import Registrar, WorkerInfo, list_workers, make_client, worker_key
from engine.checks import FieldError
from pdserve.cli import build_parser, main

CLUSTER = "users"
ROOT_PW, WORKER_PW, ROUTER_PW = (
    "root-0123456789abcdef",
    "worker-0123456789abcdef",
    "router-0123456789abcdef",
)


def _info(worker_id: str = "d1") -> WorkerInfo:
    return WorkerInfo(worker_id, "decode", "127.0.0.1:5", "m", "c", 16)


def _etcd_users(endpoint: str, *flags: str) -> list[str]:
    return ["etcd-users", "--etcd", endpoint, "--cluster", CLUSTER, *flags]


@pytest.fixture
def passwords(monkeypatch, tmp_path):
    """root's and the router's password in variables, the worker's in a file (both ways)."""
    monkeypatch.setenv(ROOT_PASSWORD_ENV, ROOT_PW)
    monkeypatch.setenv(ROUTER_PASSWORD_ENV, ROUTER_PW + "\n")  # a Secret's file: its newline
    monkeypatch.delenv(WORKER_PASSWORD_ENV, raising=False)
    worker_file = tmp_path / "worker.password"
    worker_file.write_text(WORKER_PW + "\n")
    return ["--worker-password-file", str(worker_file)]


def _worker(password: str = WORKER_PW) -> EtcdCredentials:
    return EtcdSecurity(WORKER_USER).resolve({PASSWORD_ENV: password})


def _router(password: str = ROUTER_PW) -> EtcdCredentials:
    return EtcdSecurity(ROUTER_USER).resolve({PASSWORD_ENV: password + "\n"})


async def _register_and_read(
    endpoint: str, worker: EtcdCredentials, router: EtcdCredentials
) -> None:
    """The worker's user registers; the router's reads it and cannot write."""
    registrar = Registrar(endpoint, CLUSTER, _info, ttl_s=2, credentials=worker)
    await registrar.start()
    try:
        async with make_client(endpoint, router) as client:
            assert [w.worker_id for w in await list_workers(client, CLUSTER)] == ["d1"]
            with pytest.raises(Exception, match="permission denied"):
                await client.put(worker_key(CLUSTER, "decode", "forged"), _info().to_json())
    finally:
        await registrar.deregister()


def test_an_open_etcd_gets_the_users_and_refuses_anonymous_clients(passwords, capsys):
    with EtcdServer() as etcd:
        assert main(_etcd_users(etcd.endpoint, *passwords)) == 0
        assert "auth enabled" in capsys.readouterr().out

        async def check():
            async with make_client(etcd.endpoint) as anonymous:
                with pytest.raises(Exception, match="user name is empty"):
                    await anonymous.get_prefix(f"/pdserve/{CLUSTER}/".encode())
                with pytest.raises(Exception, match="user name is empty"):
                    await anonymous.put(worker_key(CLUSTER, "decode", "x"), _info().to_json())
            await _register_and_read(etcd.endpoint, _worker(), _router())
            async with make_client(etcd.endpoint, _worker()) as client:
                with pytest.raises(Exception, match="permission denied"):  # another cluster
                    await client.put(worker_key("other", "decode", "x"), _info().to_json())

        asyncio.run(check())


def test_a_second_run_changes_nothing_and_a_changed_password_is_set(passwords, monkeypatch, capsys):
    with EtcdServer() as etcd:
        assert main(_etcd_users(etcd.endpoint, *passwords)) == 0
        capsys.readouterr()
        assert main(_etcd_users(etcd.endpoint, *passwords)) == 0
        out = capsys.readouterr().out
        assert "auth already on with these users" in out and "nothing changed" in out
        asyncio.run(_register_and_read(etcd.endpoint, _worker(), _router()))

        new_router_pw = "router-rotated-0123456789"
        monkeypatch.setenv(ROUTER_PASSWORD_ENV, new_router_pw)
        assert main(_etcd_users(etcd.endpoint, *passwords)) == 0
        assert f"changed: user {ROUTER_USER}: password set" in capsys.readouterr().out

        async def check():
            with pytest.raises(Exception, match="authentication failed"):
                async with make_client(etcd.endpoint, _router()) as client:
                    await client.get_prefix(b"/pdserve/")
            await _register_and_read(etcd.endpoint, _worker(), _router(new_router_pw))

        asyncio.run(check())


def test_a_stray_permission_of_the_router_role_is_revoked(passwords, capsys):
    """The command makes its users exactly as planned: a write permission someone granted
    the router's role by hand goes on the next run."""
    import grpc
    from aetcd import rpc

    with EtcdServer() as etcd:
        assert main(_etcd_users(etcd.endpoint, *passwords)) == 0
        with grpc.insecure_channel(etcd.endpoint) as channel:
            stub = rpc.AuthStub(channel)
            token = stub.Authenticate(rpc.AuthenticateRequest(name="root", password=ROOT_PW)).token
            stub.RoleGrantPermission(
                rpc.AuthRoleGrantPermissionRequest(
                    name=ROUTER_USER,
                    perm=rpc.Permission(
                        permType=rpc.Permission.READWRITE, key=b"/", range_end=b"\0"
                    ),
                ),
                metadata=(("token", token),),
            )
        capsys.readouterr()
        assert main(_etcd_users(etcd.endpoint, *passwords)) == 0
        out = capsys.readouterr().out
        assert f"role {ROUTER_USER}: revoked read and write every key from /" in out, out
        assert "granted" not in out, out  # its own permission stayed
        asyncio.run(_register_and_read(etcd.endpoint, _worker(), _router()))


def test_a_wrong_root_password_on_an_authenticated_etcd_stops_it(passwords, monkeypatch, capsys):
    with EtcdServer() as etcd:
        assert main(_etcd_users(etcd.endpoint, *passwords)) == 0
        capsys.readouterr()
        monkeypatch.setenv(ROOT_PASSWORD_ENV, "not-the-root-password")
        monkeypatch.setenv(ROUTER_PASSWORD_ENV, "would-be-the-new-router-password")
        assert main(_etcd_users(etcd.endpoint, *passwords)) == 1
        err = capsys.readouterr().err
        assert "has auth on and refuses root with the password given" in err, err
        assert ROOT_PASSWORD_ENV in err and "not-the-root-password" not in err
        asyncio.run(_register_and_read(etcd.endpoint, _worker(), _router()))  # unchanged


@pytest.mark.skipif(not openssl_available(), reason="no openssl CLI to make a throwaway CA")
def test_over_tls_with_a_client_certificate(passwords, tmp_path, capsys):
    tls = etcd_tls(tmp_path)
    files = dict(etcd_ca=str(tls.ca), etcd_cert=str(tls.cert), etcd_key=str(tls.key))
    with EtcdServer(tls=tls) as etcd:
        assert (
            main(
                _etcd_users(
                    etcd.endpoint,
                    *passwords,
                    "--etcd-ca",
                    files["etcd_ca"],
                    "--etcd-cert",
                    files["etcd_cert"],
                    "--etcd-key",
                    files["etcd_key"],
                )
            )
            == 0
        )
        assert "auth enabled" in capsys.readouterr().out
        worker = EtcdSecurity(WORKER_USER, **files).resolve({PASSWORD_ENV: WORKER_PW})
        router = EtcdSecurity(ROUTER_USER, **files).resolve({PASSWORD_ENV: ROUTER_PW})
        asyncio.run(_register_and_read(etcd.endpoint, worker, router))


def test_an_unreachable_etcd_is_named(passwords, capsys):
    from cluster.net import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    assert main(_etcd_users(endpoint, *passwords, "--timeout", "2")) == 1
    err = capsys.readouterr().err
    assert f"etcd at {endpoint}: " in err and ("UNAVAILABLE" in err or "DEADLINE" in err), err


# ---- no etcd needed ----------------------------------------------------------------------


def _sub() -> argparse.ArgumentParser:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["etcd-users"]


def test_passwords_cannot_be_flags():
    options = [o for a in _sub()._actions for o in a.option_strings]
    assert {"--root-password-file", "--worker-password-file", "--router-password-file"} <= set(
        options
    )
    assert [o for o in options if "password" in o and not o.endswith("-password-file")] == []
    for flag in ("--root-password", "--worker-password", "--router-password"):
        with pytest.raises(SystemExit) as exit_:  # not taken for --...-password-file
            build_parser().parse_args(["etcd-users", "--etcd", "e:1", flag, "s3cret-s3cret-s3cret"])
        assert exit_.value.code == 2


def test_passwords_and_flags_are_checked_before_etcd_is_called(tmp_path, monkeypatch, capsys):
    for name in (ROOT_PASSWORD_ENV, WORKER_PASSWORD_ENV, ROUTER_PASSWORD_ENV):
        monkeypatch.delenv(name, raising=False)
    config = EtcdUsersConfig(etcd="127.0.0.1:1", cluster=CLUSTER)
    with pytest.raises(
        ValueError, match=f"no password: give --root-password-file or set {ROOT_PASSWORD_ENV}"
    ):
        config.plan({})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="--worker-password-file .*: the file is empty"):
        EtcdUsersConfig(etcd="e:1", worker_password_file=str(empty)).plan(
            {ROOT_PASSWORD_ENV: ROOT_PW}
        )
    plan = config.plan(
        {ROOT_PASSWORD_ENV: ROOT_PW, WORKER_PASSWORD_ENV: WORKER_PW, ROUTER_PASSWORD_ENV: ROUTER_PW}
    )
    assert [(u.name, u.prefix, u.write) for u in plan.users] == [
        (WORKER_USER, b"/pdserve/users/", True),
        (ROUTER_USER, b"/pdserve/users/", False),
    ]
    assert ROOT_PW not in repr(plan) and WORKER_PW not in repr(plan)
    for kwargs, field in [
        (dict(etcd="nope"), "etcd"),
        (dict(cluster="a/b"), "cluster"),
        (dict(router_user=WORKER_USER), "router_user"),
        (dict(worker_user="root"), "router_user"),
        (dict(timeout=0.0), "timeout"),
    ]:
        with pytest.raises(FieldError) as err:
            EtcdUsersConfig(**{"etcd": "e:1", **kwargs})
        assert err.value.field == field
    # a short password is refused before etcd is reached (there is none at port 1)
    monkeypatch.setenv(ROOT_PASSWORD_ENV, ROOT_PW)
    monkeypatch.setenv(WORKER_PASSWORD_ENV, "short")
    monkeypatch.setenv(ROUTER_PASSWORD_ENV, ROUTER_PW)
    assert main(["etcd-users", "--etcd", "127.0.0.1:1"]) == 2
    assert f"{WORKER_USER}'s password has 5 characters; use at least 16" in capsys.readouterr().err
