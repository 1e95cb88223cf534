"""The endpoint picker's part of the router's configuration (router/endpoint_picker/picker.py,
router/endpoint_picker/ext_proc.py; docs/kubernetes.md, "Router as endpoint picker")."""

from __future__ import annotations

from dataclasses import dataclass

from engine.checks import check_fields
from engine.flags import option

GROUP = "endpoint picker (Gateway API Inference Extension)"
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})
"""Listen addresses that are no address to send requests to."""


@dataclass(frozen=True)
class EndpointPickerConfig:
    port: int = option(0, name="--endpoint-picker-port", group=GROUP, metavar="PORT")
    """Also serve the Gateway API Inference Extension endpoint picker on this port: Envoy's
    ext_proc gRPC service (envoy.service.ext_proc.v3.ExternalProcessor, plus grpc.health.v1),
    which places each request with this router's placement and answers with the router
    endpoint to send it to (x-gateway-destination-endpoint) and the chosen workers
    (x-pdserve-decode-worker, x-pdserve-prefill-worker), which this router then follows.
    0: off (the HTTP API alone; the headers are ignored)."""
    endpoint: str | None = option(
        None, name="--endpoint-picker-endpoint", group=GROUP, metavar="IP:PORT"
    )
    """This router's HTTP endpoint as the gateway reaches it (its InferencePool endpoint), the
    picker's answer unless the gateway restricts the choice to a subset without it. Default:
    --host:--port (in Kubernetes: $(POD_IP):8000)."""

    def __post_init__(self) -> None:
        check_fields(
            self,
            [
                (0 <= self.port < 65536, "port", "must be in 0..65535 (0: off)"),
                (
                    self.endpoint is None or _is_host_port(self.endpoint),
                    "endpoint",
                    "must be IP:PORT",
                ),
            ],
        )


def _is_host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
