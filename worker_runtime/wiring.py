"""The runtime's side of the rooms' contexts (contexts.py): each context built from a
`WorkerRuntime`, the only place that knows which runtime part answers what. The entry point
(pdserve/worker_main.py) and the test harnesses pass these to the rooms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker_runtime.contexts import (
    DecodeContext,
    EngineSide,
    ExportContext,
    PeerContext,
    PrefillContext,
    PullContext,
    ServingContext,
)
from worker_runtime.runtime import WorkerRuntime
from worker_runtime.service import ServiceContext


@dataclass(frozen=True, slots=True)
class RoomContexts:
    """Every room's context of one worker."""

    service: ServiceContext
    peers: PeerContext
    pull: PullContext
    export: ExportContext
    prefill: PrefillContext
    decode: DecodeContext


def room_contexts(rt: WorkerRuntime) -> RoomContexts:
    side = engine_side(rt)
    serving = _serving(rt, side)
    return RoomContexts(
        service=ServiceContext(
            info=rt.info,
            abort=rt.abort,
            kv_events=rt.kv_events.subscribe,
            cached_blocks=rt.cached_blocks,
            adapters=rt.adapters,
            lifecycle=rt.lifecycle,
            roles=rt.roles,
            role=lambda: rt.admission.role,
            enable_admin_rpcs=rt.config.enable_admin_rpcs,
        ),
        peers=PeerContext(
            cluster=rt.config.cluster,
            etcd=rt.config.etcd,
            etcd_credentials=rt.etcd_credentials,
            worker_id=lambda: rt.worker_id,
            add_peer=rt.kv.add_peer,
        ),
        pull=PullContext(
            **_fields(side),
            receiver=rt.pull_receiver,
            auth=rt.auth,
            worker_id=lambda: rt.worker_id,
            own_metadata=rt.own_metadata,
            block_size=rt.engine.config.block_size,
            prefill_tokens_per_s=lambda: rt.loop.prefill_steps.prompt_tokens_per_s,
            observe_pull=rt.pull_cost.observe,
        ),
        export=ExportContext(**_fields(side), sender=rt.pull_sender, add_peer=rt.kv.add_peer),
        prefill=PrefillContext(
            **_fields(serving),
            sender=rt.sender,
            listen_sender=rt.listen_sender,
            add_peer=rt.kv.add_peer,
            call_later=rt.call_later,
        ),
        decode=DecodeContext(
            **_fields(serving),
            receiver=rt.receiver,
            deliver=rt.deliver,
            auth=rt.auth,
            own_metadata=rt.own_metadata,
            strict_remote_prefill=rt.config.strict_remote_prefill,
            vocab_size=rt.engine.loaded.args.vocab_size,
            preview_first=rt.engine.preview_remote_first,
        ),
    )


def engine_side(rt: WorkerRuntime) -> EngineSide:
    return EngineSide(
        call=rt.call,
        settle=rt.settle,
        add_step_hook=rt.add_step_hook,
        add_abort_hook=rt.add_abort_hook,
        create_future=rt.create_future,
        create_task=rt.create_task,
        kv_timeout_s=rt.config.kv_timeout_s,
        metrics=rt.metrics,
    )


def _serving(rt: WorkerRuntime, side: EngineSide) -> ServingContext:
    return ServingContext(
        **_fields(side),
        admitted=rt.admission.admitted,
        make_request=rt.make_request,
        limits=rt.engine.limits,
        open_stream=rt.open_stream,
        close_stream=rt.close_stream,
    )


def _fields(ctx: EngineSide) -> dict[str, Any]:
    """A context's fields, to build a wider context from it."""
    return {name: getattr(ctx, name) for name in ctx.__dataclass_fields__}
