"""An ext_proc client that talks to an endpoint picker as Envoy's ext_proc HTTP filter does
(no Envoy binary is installable here): one `Process` stream per HTTP request, the request
headers first (with `protocol_config` announcing the body mode, as Envoy sends it on the first
message), then the body; in BUFFERED mode it waits for the headers answer before it sends the
body, in FULL_DUPLEX_STREAMED mode it sends the body straight after the headers. Messages are
Envoy's own (`xds-protos`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc
from envoy.config.core.v3 import base_pb2 as core
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import json_format, struct_pb2

BUFFERED = mode.ProcessingMode.BUFFERED
FULL_DUPLEX = mode.ProcessingMode.FULL_DUPLEX_STREAMED


@dataclass
class Answer:
    """What the picker told the gateway about one request."""

    responses: list[ep.ProcessingResponse]
    headers: dict[str, str]
    """Request headers it set (empty for an immediate response)."""
    metadata: dict
    """Its dynamic metadata, as JSON."""
    body: bytes | None = None
    """The request body it streamed back (FULL_DUPLEX_STREAMED)."""
    status: int | None = None
    """An immediate response's HTTP status (None: the request goes upstream)."""
    error: dict | None = None
    """An immediate response's JSON body."""
    clear_route_cache: bool = False


def _headers(path: str, extra: dict[str, str], end: bool) -> ep.HttpHeaders:
    values = {
        ":method": "POST",
        ":path": path,
        ":authority": "gateway",
        "content-type": "application/json",
        **extra,
    }
    return ep.HttpHeaders(
        end_of_stream=end,
        headers=core.HeaderMap(
            headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
        ),
    )


def _metadata(subset: list[str] | None) -> core.Metadata:
    meta = core.Metadata()
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        meta.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return meta


async def process(
    address: str,
    path: str,
    body: bytes | None,
    *,
    body_mode=BUFFERED,
    headers: dict[str, str] | None = None,
    subset: list[str] | None = None,
    channel: grpc.aio.Channel | None = None,
) -> Answer:
    own = channel is None
    channel = channel or grpc.aio.insecure_channel(address)
    try:
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        first = ep.ProcessingRequest(
            request_headers=_headers(path, headers or {}, body is None),
            metadata_context=_metadata(subset),
            protocol_config=ep.ProtocolConfiguration(request_body_mode=body_mode),
        )
        await call.write(first)
        responses: list[ep.ProcessingResponse] = []
        if body is not None:
            if body_mode != FULL_DUPLEX:
                responses.append(await call.read())
                if responses[-1].HasField("immediate_response"):
                    return _answer(responses)
            await call.write(
                ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
            )
        await call.done_writing()
        while (resp := await call.read()) is not grpc.aio.EOF:
            responses.append(resp)
        return _answer(responses)
    finally:
        if own:
            await channel.close()


def _answer(responses: list[ep.ProcessingResponse]) -> Answer:
    out = Answer(responses, {}, {})
    streamed = b""
    for resp in responses:
        which = resp.WhichOneof("response")
        if which == "immediate_response":
            imm = resp.immediate_response
            out.status = imm.status.code
            out.error = json.loads(imm.body)
            continue
        common = getattr(resp, which).response
        out.clear_route_cache |= common.clear_route_cache
        for h in common.header_mutation.set_headers:
            out.headers[h.header.key] = h.header.raw_value.decode() or h.header.value
        if common.body_mutation.HasField("streamed_response"):
            streamed += common.body_mutation.streamed_response.body
            out.body = streamed
        if resp.HasField("dynamic_metadata"):
            out.metadata.update(json_format.MessageToDict(resp.dynamic_metadata))
    return out
