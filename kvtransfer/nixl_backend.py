"""The NIXL backend: one-sided WRITEs of whole blocks into a peer's pool, over UCX.

The pool is registered as one region; both pools are described block by block (one
descriptor per block, prepared once: ours at registration, a peer's when it is added), so a
batch is `make_prepped_xfer(WRITE, our indices, their indices, notification)`. Works the same
for CPU (DRAM) and CUDA (VRAM) pools; UCX picks the path (CMA on one host, RDMA/NVLink/
cuda_ipc on GPU machines).

Progress: no thread. UCX advances only inside our calls, so the worker's loop calls
`sender.poll()` / `receiver.poll()` every step (each is a few microseconds when idle). On one
host UCX writes with CMA, which copies inside the posting call: `send` returns after its batch
is copied, so keep batches to what one engine step produced. A batch's flush and notification
complete only once the receiver has polled, so the sender's COMPLETE trails the receiver's
poll period. NIXL's own progress thread (`KVTransferConfig.nixl_progress_thread`) spins
without delay and is off by default.

Dead peers: posting to, or notifying, a peer whose process died raises
NIXL_ERR_REMOTE_DISCONNECT (UCX notices the closed socket within milliseconds on one host);
the request fails and the peer is marked dead. Writes that hang without an error are ended
by the request's deadline, which releases (cancels) their handles.
"""
from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import numpy as np

from kvtransfer.backend import TransportBackend
from kvtransfer.base import KVTransferConfig
from kvtransfer.errors import KVTransferError, MetadataError
from kvtransfer.metadata import PeerMetadata
from kvtransfer.transport import Transport, TransportError, WriteState

log = logging.getLogger(__name__)

_STATES = {"DONE": WriteState.DONE, "PROC": WriteState.PROC}


def block_descs(base_addr: int, num_blocks: int, block_bytes: int, device_id: int) -> np.ndarray:
    """NIXL descriptors (address, length, device) of every block of a block-major pool."""
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(base_addr) + np.arange(num_blocks, dtype=np.uint64) * np.uint64(
        block_bytes
    )
    descs[:, 1] = block_bytes
    descs[:, 2] = device_id
    return descs


class NixlTransport(Transport):
    name = "nixl"

    def __init__(self, agent_name: str, config: KVTransferConfig) -> None:
        if config.ucx_net_devices is not None:
            os.environ.setdefault("UCX_NET_DEVICES", config.ucx_net_devices)
        # UCX logs to stdout unless told otherwise; a worker's stdout carries its READY line
        # (local_cluster/launcher.py), which a log line written mid-line would garble.
        os.environ.setdefault("UCX_LOG_FILE", "stderr")
        from nixl import _bindings
        from nixl._api import nixl_agent, nixl_agent_config

        self._disconnect_error = _bindings.nixlRemoteDisconnectError
        conf = nixl_agent_config(
            enable_prog_thread=config.nixl_progress_thread,
            enable_listen_thread=False,
            backends=list(config.nixl_backends),
        )
        self._agent = nixl_agent(agent_name, conf)
        if not self._agent.backends:
            raise KVTransferError(f"NIXL could not start any of {config.nixl_backends}")
        self._reg: Any = None
        self._local: Any = None
        self._mem_type = "DRAM"
        self._remote: dict[str, Any] = {}

    def register(self, kv_cache: Any, block_bytes: int) -> bytes:
        self._mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        device = kv_cache.get_device() if kv_cache.is_cuda else 0
        self._reg = self._agent.register_memory(kv_cache)
        descs = block_descs(kv_cache.data_ptr(), kv_cache.shape[0], block_bytes, device)
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, self._mem_type)
        return self._agent.get_agent_metadata()

    def connect(self, meta: PeerMetadata) -> None:
        try:
            loaded = self._agent.add_remote_agent(meta.agent_metadata)
        except Exception as e:
            raise MetadataError(f"NIXL refused the metadata of {meta.agent_name!r}: {e}") from e
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != meta.agent_name:
            self._forget(name)
            raise MetadataError(
                f"peer metadata names agent {meta.agent_name!r} but its NIXL blob is {name!r}"
            )
        descs = block_descs(meta.base_addr, meta.num_blocks, meta.block_bytes, meta.device_id)
        try:
            self._remote[name] = self._agent.prep_xfer_dlist(name, descs, meta.mem_type)
        except Exception as e:
            self._forget(name)
            raise MetadataError(
                f"the pool described by {name!r}'s metadata is not registered memory of that "
                f"agent: {e}"
            ) from e
        try:
            self._agent.make_connection(name)
        except Exception as e:  # reported per request by the first write
            log.warning("NIXL could not pre-connect to %r: %s", name, e)

    def disconnect(self, name: str) -> None:
        handle = self._remote.pop(name, None)
        if handle is not None:
            handle.release()
        self._forget(name)

    def post_write(self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes) -> Any:
        handle = None
        try:
            handle = self._agent.make_prepped_xfer(
                "WRITE", self._local, local.astype(np.int32), self._remote[peer],
                remote.astype(np.int32), notif,
            )
            state = self._agent.transfer(handle)
        except Exception as e:
            if handle is not None and not self.release(handle):
                log.error("leaking a NIXL handle that failed to post")
            raise TransportError(str(e), disconnected=isinstance(e, self._disconnect_error)) from e
        if state == "ERR":
            self.release(handle)
            raise TransportError("NIXL refused to post the write")
        return handle

    def check(self, handle: Any) -> WriteState:
        try:
            return _STATES.get(self._agent.check_xfer_state(handle), WriteState.ERR)
        except Exception:
            return WriteState.ERR

    def release(self, handle: Any) -> bool:
        try:
            handle.release()
            return True
        except Exception as e:
            log.debug("NIXL handle not released yet: %s", e)
            return False

    def send_notif(self, peer: str, msg: bytes) -> None:
        try:
            self._agent.send_notif(peer, msg)
        except Exception as e:
            raise TransportError(str(e), disconnected=isinstance(e, self._disconnect_error)) from e

    def fetch_notifs(self) -> list[tuple[str, bytes]]:
        notifs = self._agent.get_new_notifs()
        return [
            (agent.decode() if isinstance(agent, bytes) else agent, msg)
            for agent, msgs in notifs.items()
            for msg in msgs
        ]

    def deregister(self) -> None:
        if self._local is not None:
            self._local.release()
            self._local = None
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None

    def close(self) -> None:
        for name in list(self._remote):
            self.disconnect(name)
        if self._local is not None:
            self._local.release()
            self._local = None
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None

    def _forget(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:
            log.debug("NIXL remove_remote_agent(%r): %s", name, e)


class NixlTransferBackend(TransportBackend):
    """KVTransferBackend over NIXL; see `kvtransfer.base` for the contract."""

    def __init__(self, config: KVTransferConfig | None = None) -> None:
        config = config or KVTransferConfig()
        name = config.agent_name or f"pdserve-{uuid.uuid4().hex[:12]}"
        super().__init__(NixlTransport(name, config), name, config)
