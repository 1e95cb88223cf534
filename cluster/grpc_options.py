"""gRPC channel and server options every process of a cluster shares, so the two ends agree.

Keepalive: a channel pings its server every KEEPALIVE_TIME_MS while calls are open (the
router's KV-event subscription is always open), to notice a dead worker. A server answers
pings that arrive faster than it permits (gRPC's default: one per 5 minutes while it sends
no data) with GOAWAY `too_many_pings`, which fails every call on the connection: the router
then saw UNAVAILABLE from a healthy worker and answered 503. Servers here permit twice the
channels' ping rate."""

from __future__ import annotations

KEEPALIVE_TIME_MS = 10_000

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", 5_000),
]

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.keepalive_permit_without_calls", 1),
]
