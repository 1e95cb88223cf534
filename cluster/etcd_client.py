"""The one way a pdserve process opens an etcd client: `make_client(endpoint, credentials)`
(the router's watch, a worker's registration, the prefill worker's destination check,
`pdserve status`, the planner, the chaos checks).

aetcd 1.0.0's Client authenticates with a user and password (etcd's Authenticate RPC; the
token then rides on every call) but opens only plain gRPC channels; `_TlsClient` is that
client over a TLS channel. An `https://` endpoint is always TLS: with --etcd-ca's CA, else
the system's trusted roots (never plaintext to an endpoint that asked for TLS).
"""

from __future__ import annotations

import asyncio
import functools

from cluster.etcd_security import EtcdCredentials, EtcdTls


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.removeprefix("http://").removeprefix("https://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"etcd endpoint must be host:port, got {endpoint!r}")
    return host, int(port)


def make_client(endpoint: str, credentials: EtcdCredentials | None = None, timeout: float = 2.0):
    """An unconnected aetcd client for `endpoint` (use `async with`), authenticated and over
    TLS as `credentials` say (None: anonymous, plain gRPC), or as the endpoint says
    (`https://`: TLS, checked against the system's roots when no CA is given)."""
    import aetcd

    host, port = parse_endpoint(endpoint)
    creds = credentials or EtcdCredentials()
    kwargs = dict(username=creds.user, password=creds.password, timeout=timeout)
    tls = creds.tls
    if tls is None and endpoint.startswith("https://"):
        tls = SYSTEM_ROOTS
    if tls is None:
        return aetcd.Client(host, port, **kwargs)
    return _tls_client_class()(host, port, tls=tls, **kwargs)


SYSTEM_ROOTS = EtcdTls(ca=None)
"""TLS against the system's trusted roots (an `https://` endpoint without --etcd-ca)."""


def channel_credentials(tls: EtcdTls):
    """grpc channel credentials of a client of an etcd serving TLS."""
    import grpc

    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
    )


@functools.cache
def _tls_client_class() -> type:
    import aetcd
    from aetcd import rpc, watcher
    from aetcd.client import _handle_errors

    class _TlsClient(aetcd.Client):
        """aetcd.Client whose `connect` opens a TLS channel (the rest of 1.0.0's connect,
        unchanged: authenticate when a user is given, then the stubs and the watcher)."""

        _is_connecting: bool  # set by aetcd.Client.__init__

        def __init__(self, host: str, port: int, *, tls, **kwargs) -> None:
            super().__init__(host, port, **kwargs)
            self._channel_credentials = channel_credentials(tls)

        @_handle_errors
        async def connect(self) -> None:
            if self._connected.is_set():
                return
            if self._is_connecting:
                await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
                return
            try:
                self._is_connecting = True
                self.channel = rpc.secure_channel(
                    f"{self._host}:{self._port}",
                    self._channel_credentials,
                    options=self._options.items(),
                )
                if self._username is not None:
                    self.auth_stub = rpc.AuthStub(self.channel)
                    resp = await self.auth_stub.Authenticate(
                        rpc.AuthenticateRequest(name=self._username, password=self._password),
                        timeout=self._timeout,
                    )
                    self.metadata = (("token", resp.token),)
                self.kvstub = rpc.KVStub(self.channel)
                self.clusterstub = rpc.ClusterStub(self.channel)
                self.leasestub = rpc.LeaseStub(self.channel)
                self.maintenancestub = rpc.MaintenanceStub(self.channel)
                self._watcher = watcher.Watcher(
                    rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
                )
                self._connected.set()
            finally:
                self._is_connecting = False

    return _TlsClient
