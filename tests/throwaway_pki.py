"""A throwaway certificate authority for tests and benchmarks of the gRPC mutual TLS
(cluster/grpc_security.py), made with the `openssl` command line: a CA and one certificate
(for `localhost` / `127.0.0.1` by default) that a process presents both as server and as client
(as every process of one `pdserve up` does). Valid for one day; never for a real cluster."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.etcd_server import ServerTls

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Pki:
    """PEM file paths."""

    ca: Path
    cert: Path
    key: Path


def openssl_available() -> bool:
    return shutil.which("openssl") is not None


def make_pki(
    directory: Path, name: str = "pdserve", hosts: tuple[str, ...] = ("localhost", "127.0.0.1")
) -> Pki:
    """A CA `<name>-ca` and a certificate signed by it for `hosts` (names or IP addresses;
    server and client use), under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    d = directory
    ca, ca_key = d / f"{name}-ca.pem", d / f"{name}-ca.key"
    cert, key, csr, ext = (
        d / f"{name}.pem",
        d / f"{name}.key",
        d / f"{name}.csr",
        d / f"{name}.ext",
    )
    _openssl(
        "req",
        "-x509",
        *_EC,
        "-keyout",
        ca_key,
        "-out",
        ca,
        "-days",
        "1",
        "-subj",
        f"/CN={name}-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    _openssl("req", *_EC, "-keyout", key, "-out", csr, "-subj", f"/CN={name}-node")
    alt = ",".join(f"IP:{h}" if h.replace(".", "").isdigit() else f"DNS:{h}" for h in hosts)
    ext.write_text(
        f"basicConstraints=CA:FALSE\nsubjectAltName={alt}\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        ca,
        "-CAkey",
        ca_key,
        "-CAcreateserial",
        "-out",
        cert,
        "-days",
        "1",
        "-extfile",
        ext,
    )
    return Pki(ca, cert, key)


def _openssl(*args: object) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def etcd_tls(directory: Path) -> ServerTls:
    """A throwaway CA and a certificate for an etcd on 127.0.0.1 (`EtcdServer(tls=...)`); the
    same certificate serves a client presenting one (etcd's --client-cert-auth)."""
    from cluster.etcd_server import ServerTls

    pki = make_pki(directory, name="etcd", hosts=("127.0.0.1",))
    return ServerTls(pki.cert, pki.key, pki.ca)
