"""A throwaway CA and one certificate for an etcd on 127.0.0.1 (server and client use), made
with the `openssl` CLI: for tests and benchmarks of etcd over TLS (cluster/etcd_server.py
`ServerTls`). Not a certificate authority for production: the key sits next to the
certificate, valid for a day."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from cluster.etcd_server import ServerTls

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def openssl_available() -> bool:
    return shutil.which("openssl") is not None


def throwaway_ca(where: Path) -> ServerTls:
    """ca.pem, etcd.pem and etcd.key in `where` (keys 0600); FileNotFoundError without the
    openssl CLI."""
    if not openssl_available():
        raise FileNotFoundError("the openssl CLI is needed to make a throwaway CA")
    (where / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n"
                                   "extendedKeyUsage=serverAuth,clientAuth\n")
    for cmd in (["req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
                 "-subj", "/CN=pdserve-throwaway-ca"],
                ["req", *_EC, "-keyout", "etcd.key", "-out", "etcd.csr", "-subj", "/CN=etcd"],
                ["x509", "-req", "-in", "etcd.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", "etcd.pem", "-days", "1", "-extfile", "ext.cnf"]):
        subprocess.run(["openssl", *cmd], cwd=where, check=True, capture_output=True)
    for key in ("ca.key", "etcd.key"):
        (where / key).chmod(0o600)
    return ServerTls(where / "etcd.pem", where / "etcd.key", where / "ca.pem")
