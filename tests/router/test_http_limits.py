"""The router's HTTP-layer limits (router/http/limits.py) on a real uvicorn server over fake
workers, driven with raw sockets so that a test controls exactly what was sent: a body over
the cap is a 413 before it is read (and /health answers meanwhile), a chunked one as it
passes the cap; a body that stops arriving is a 408; connections dribbling their headers
(slowloris) are closed at the header timeout."""

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from router_harness import start_cluster

from router.config import LimitsConfig
from router.http.limits import uvicorn_options

CAP = 1 << 20
LIMITS = LimitsConfig(
    max_request_body_bytes=CAP,
    request_header_timeout_s=1.0,
    request_body_timeout_s=1.0,
    limit_concurrency=64,
)


@pytest.fixture(scope="module")
def cluster(etcd, bg):
    c = start_cluster(bg, etcd.endpoint, "http-limits", [("decode", "d1")], limits=LIMITS)
    yield c
    c.stop()


@pytest.fixture
def handled(cluster, monkeypatch):
    """The bodies the handlers parsed (services.tokenizing: every body-parsing route)."""
    calls = []
    real = cluster.services.tokenizing

    async def recording(size, fn, *args):
        calls.append(size)
        return await real(size, fn, *args)

    monkeypatch.setattr(cluster.services, "tokenizing", recording)
    return calls


def _connect(cluster) -> socket.socket:
    url = urlsplit(cluster.router.url)
    return socket.create_connection((url.hostname, url.port), timeout=10)


def _head(path: str, **headers: str) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: localhost",
        "Content-Type: application/json",
        *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed without a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(status_line.split()[1]), headers, body


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def _error(body: bytes, code: str) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == code, err
    return err


def test_a_body_over_the_cap_is_a_413_before_it_is_read(cluster, handled):
    """The attack: one unauthenticated 8 MB /tokenize. Its Content-Length is refused at once:
    the client has sent 64 KiB of it when the 413 arrives, no handler ran, and /health
    answered while the connection was open."""
    with _connect(cluster) as sock:
        sock.sendall(
            _head("/tokenize", Content_Length="8000000") + b'{"prompt": "' + b"a" * (64 << 10)
        )
        assert httpx.get(cluster.router.url + "/health", timeout=5).status_code == 200
        status, headers, body = _response(sock)
        assert status == 413 and headers["connection"] == "close"
        assert "max-request-body-bytes" in _error(body, "request_too_large")["message"]
        assert _closed(sock)  # the other 7.9 MB are never read
    assert handled == []


def test_a_chunked_body_is_a_413_once_it_passes_the_cap(cluster, handled):
    """No Content-Length: the bytes are counted as they stream in; the request is refused
    when they pass the cap, before the body ends (the last chunk is never sent)."""
    with _connect(cluster) as sock:
        sock.sendall(_head("/v1/completions", Transfer_Encoding="chunked"))
        chunk = 64 << 10
        for _ in range(CAP // chunk):
            sock.sendall(b"%x\r\n%s\r\n" % (chunk, b" " * chunk))
        sock.sendall(b"1\r\n \r\n")  # one byte over the cap
        status, _, body = _response(sock)
        assert status == 413
        _error(body, "request_too_large")
        assert _closed(sock)
    assert handled == []  # the handler was still reading its body


def test_a_body_that_stops_arriving_is_a_408(cluster, handled):
    with _connect(cluster) as sock:
        sock.sendall(_head("/v1/completions", Content_Length="1000") + b'{"prompt": ')
        status, headers, body = _response(sock)
        assert status == 408 and headers["connection"] == "close"
        assert "did not arrive within 1 s" in _error(body, "request_timeout")["message"]
        assert _closed(sock)
    assert handled == []


def _dribble(socks: list[socket.socket], seconds: float) -> list[float | None]:
    """One header line per socket every 0.2 s, for `seconds`; when each was closed (None:
    still open at the end)."""
    start = time.monotonic()
    closed: list[float | None] = [None] * len(socks)
    while time.monotonic() - start < seconds and None in closed:
        for i, sock in enumerate(socks):
            if closed[i] is None:
                try:
                    sock.sendall(b"X-Slow: 1\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    closed[i] = time.monotonic() - start
        time.sleep(0.2)
    return closed


def test_connections_dribbling_their_headers_are_closed(cluster):
    """Slowloris: 8 connections sending a header line every 0.2 s, forever; the header
    timeout (1 s here) closes each, and /health answers meanwhile."""
    socks = [_connect(cluster) for _ in range(8)]
    try:
        for sock in socks:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        assert httpx.get(cluster.router.url + "/health", timeout=5).status_code == 200
        closed = _dribble(socks, seconds=6.0)
        assert None not in closed, closed  # all closed well before the dribble's end
    finally:
        for sock in socks:
            sock.close()


def test_a_keep_alive_connection_gets_the_same_header_timeout(cluster):
    with _connect(cluster) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        status, _, _ = _response(sock)
        assert status == 200
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # the next head starts, then dribbles
        assert _dribble([sock], seconds=6.0) != [None]


def test_uvicorn_gets_the_concurrency_and_keep_alive_limits(cluster):
    config = cluster.router.server.config
    assert config.limit_concurrency == 64 and config.timeout_keep_alive == 5.0
    assert uvicorn_options(LimitsConfig())["limit_concurrency"] == 2048
