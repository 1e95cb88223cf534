"""The endpoint picker on the wire: Envoy's external processing service
(`envoy.service.ext_proc.v3.ExternalProcessor`, messages from the `xds-protos` package) as the
Gateway API Inference Extension's endpoint picker protocol uses it, plus `grpc.health.v1`.

One `Process` stream per HTTP request. Life cycle of a request here:
1. Request headers arrive (the path, the API key); with body mode BUFFERED they are answered
   at once (CONTINUE); with FULL_DUPLEX_STREAMED (GAIE v1's mode, announced in the first
   message's `protocol_config`) the answer waits for the body. A request without a body
   (`end_of_stream` on its headers) is picked from the headers alone.
2. Body chunks are collected until `end_of_stream`; then `EndpointPicker.pick` decides. A body
   that grows past --max-request-body-bytes is refused (413) at the chunk that crosses it.
3. The answer sets the request headers `x-gateway-destination-endpoint` (the router, IP:PORT),
   `x-pdserve-decode-worker` and `x-pdserve-prefill-worker` (router/placement/hint.py), and the
   same endpoint under `envoy.lb` in the dynamic metadata; the route cache is cleared so the
   destination header is routed on. BUFFERED: on the body response; FULL_DUPLEX_STREAMED: on
   the headers response, followed by the body streamed back unchanged.
   A refusal is an `ImmediateResponse`: the router's own status and OpenAI error body.
4. Response headers, bodies and trailers (if the gateway sends them) pass unchanged.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
from envoy.config.core.v3 import base_pb2 as core
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.endpoint_picker.picker import EndpointPicker, Pick
from router.http.errors import APIError
from router.http.limits import too_large
from router.placement.hint import HintSeal

log = logging.getLogger(__name__)

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVICE_NAME = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
HEALTH_SERVICES = ("", "liveness", "readiness", SERVICE_NAME)
_FULL_DUPLEX = mode.ProcessingMode.FULL_DUPLEX_STREAMED


@dataclass
class _Exchange:
    """One HTTP request's ext_proc stream."""

    full_duplex: bool = False
    path: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    subset: list[str] | None = None
    picked: bool = False


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    def __init__(self, picker: EndpointPicker, max_body_bytes: int) -> None:
        self.picker = picker
        self.max_body_bytes = max_body_bytes

    async def Process(
        self,
        request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ep.ProcessingResponse]:
        """/// One HTTP request through the gateway: answers each message (module docstring)."""
        ex = _Exchange()
        async for req in request_iterator:
            for resp in await self._on(ex, req):
                yield resp

    async def _on(self, ex: _Exchange, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if req.HasField("protocol_config"):
            ex.full_duplex = req.protocol_config.request_body_mode == _FULL_DUPLEX
        if ex.subset is None:
            ex.subset = _subset(req.metadata_context)
        phase = req.WhichOneof("request")
        if phase == "request_headers":
            ex.headers = {
                h.key.lower(): h.raw_value.decode("latin-1") if h.raw_value else h.value
                for h in req.request_headers.headers.headers
            }
            ex.path = ex.headers.get(":path", "/")
            if req.request_headers.end_of_stream:
                return await self._answer(ex, body_follows=False)
            if ex.full_duplex:
                return []  # answered with the body
            return [ep.ProcessingResponse(request_headers=ep.HeadersResponse())]
        if phase == "request_body":
            ex.body += req.request_body.body
            if len(ex.body) > self.max_body_bytes:  # not held until the end of a longer body
                ex.picked = True
                return [
                    ep.ProcessingResponse(
                        immediate_response=immediate(too_large(self.max_body_bytes))
                    )
                ]
            if not req.request_body.end_of_stream:
                return (
                    []
                    if ex.full_duplex
                    else [ep.ProcessingResponse(request_body=ep.BodyResponse())]
                )
            return await self._answer(ex, body_follows=True)
        if phase == "request_trailers":
            early = [] if ex.picked or not ex.full_duplex else await self._answer(ex, True)
            return early + [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if phase == "response_headers":
            return [ep.ProcessingResponse(response_headers=ep.HeadersResponse())]
        if phase == "response_body":
            if not ex.full_duplex:
                return [ep.ProcessingResponse(response_body=ep.BodyResponse())]
            chunk = req.response_body
            return [
                ep.ProcessingResponse(
                    response_body=ep.BodyResponse(
                        response=_streamed(chunk.body, chunk.end_of_stream)
                    )
                )
            ]
        if phase == "response_trailers":
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        return []

    async def _answer(self, ex: _Exchange, body_follows: bool) -> list[ep.ProcessingResponse]:
        ex.picked = True
        try:
            pick = await self.picker.pick(ex.path, ex.headers, bytes(ex.body), ex.subset)
        except APIError as exc:
            return [ep.ProcessingResponse(immediate_response=immediate(exc))]
        except Exception:  # noqa: BLE001 - the gateway gets a 500, the detail stays here
            log.exception("endpoint picker failed on %s", ex.path)
            return [
                ep.ProcessingResponse(
                    immediate_response=immediate(APIError(500, "internal server error"))
                )
            ]
        log.debug("%s -> %s, %s (%s)", ex.path, pick.endpoint, pick.hint, pick.reason)
        seal = self.picker.services.hint_seal
        common = ep.CommonResponse(header_mutation=_mutation(pick, seal), clear_route_cache=True)
        metadata = _metadata(pick.endpoint)
        if not body_follows:
            return [
                ep.ProcessingResponse(
                    request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata
                )
            ]
        if not ex.full_duplex:
            return [
                ep.ProcessingResponse(
                    request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata
                )
            ]
        return [
            ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata
            ),
            ep.ProcessingResponse(
                request_body=ep.BodyResponse(response=_streamed(bytes(ex.body), True))
            ),
        ]


def immediate(exc: APIError) -> ep.ImmediateResponse:
    """The gateway's answer without an upstream: the router's status and OpenAI error body."""
    headers = {"content-type": "application/json", **{k.lower(): v for k, v in exc.headers.items()}}
    return ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=exc.status),
        headers=ep.HeaderMutation(set_headers=[_header(k, v) for k, v in headers.items()]),
        body=json.dumps(exc.body()).encode(),
        details=f"pdserve endpoint picker: {exc.message}",
    )


def _header(key: str, value: str) -> core.HeaderValueOption:
    return core.HeaderValueOption(
        header=core.HeaderValue(key=key, raw_value=value.encode("latin-1")),
        append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _mutation(pick: Pick, seal: HintSeal) -> ep.HeaderMutation:
    # The hint headers are always written (empty: none), so a client cannot smuggle its own
    # through the gateway; past it, the router follows only a hint that `seal` sealed.
    return ep.HeaderMutation(
        set_headers=[_header(DESTINATION_HEADER, pick.endpoint)]
        + [_header(k, v) for k, v in seal.headers(pick.hint).items()]
    )


def _metadata(endpoint: str) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update({LB_NAMESPACE: {DESTINATION_HEADER: endpoint}})
    return out


def _streamed(body: bytes, end: bool) -> ep.CommonResponse:
    return ep.CommonResponse(
        body_mutation=ep.BodyMutation(
            streamed_response=ep.StreamedBodyResponse(body=body, end_of_stream=end)
        )
    )


def _subset(metadata: core.Metadata) -> list[str] | None:
    """The endpoints the gateway allows (GAIE "Endpoint Subset"); None: no restriction."""
    hint = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET_KEY not in hint.fields:
        return None
    return [v.string_value for v in hint.fields[SUBSET_KEY].list_value.values]


async def start_picker_server(
    picker: EndpointPicker, host: str, port: int, max_body_bytes: int
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """The ext_proc + health gRPC server on host:port, started; its health services but
    `liveness` read NOT_SERVING until the caller marks them (`set_serving`). A message may
    carry a whole body up to `max_body_bytes` (a larger one is the picker's 413)."""
    limit = max_body_bytes + (64 << 10)  # + the headers and framing around it
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ]
    )
    ep_grpc.add_ExternalProcessorServicer_to_server(
        ExternalProcessor(picker, max_body_bytes), server
    )
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    for name in HEALTH_SERVICES:  # alive at once; ready once set_serving says so
        await checks.set(
            name,
            health_pb2.HealthCheckResponse.SERVING
            if name == "liveness"
            else health_pb2.HealthCheckResponse.NOT_SERVING,
        )
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"endpoint picker: cannot listen on {host}:{port}")
    await server.start()
    return server, checks


async def set_serving(checks: health.aio.HealthServicer) -> None:
    for name in HEALTH_SERVICES:
        await checks.set(name, health_pb2.HealthCheckResponse.SERVING)
