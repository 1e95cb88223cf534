"""The NIXL backend with two agents in this process (UCX loopback): fast checks of the real
transport — byte-identical writes, metadata and compatibility refusals, id checks."""

import json
import os
import time

import pytest
import torch

from kvtransfer import (
    BlockRangeError,
    IncompatiblePeerError,
    KVCompat,
    KVTransferConfig,
    MetadataError,
    NixlTransferBackend,
    PeerMetadata,
    TransferStatus,
)

pytestmark = pytest.mark.timeout(60)

SHAPE = (3, 2, 2, 16, 64)  # kv heads, layers, K/V, block_size, head_dim: 24 KiB fp32 blocks
_count = iter(range(1000))


def make(blocks, seed, model="m", device="cpu", dtype=torch.float32):
    name = f"local-{os.getpid()}-{next(_count)}"
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn((blocks, *SHAPE), generator=g).to(device=device, dtype=dtype)
    backend = NixlTransferBackend(KVTransferConfig(agent_name=name))
    backend.register_pool(pool, KVCompat.for_pool(pool, model))
    return backend, pool


def drive(backends, sends, recvs, timeout_s=10.0):
    """Poll every backend until the given sender/receiver request ids have results."""
    got_s, got_r = {}, {}
    end = time.monotonic() + timeout_s
    while (not sends <= got_s.keys() or not recvs <= got_r.keys()) and time.monotonic() < end:
        for b in backends:
            got_s.update((r.request_id, r) for r in b.sender.poll())
            got_r.update((r.request_id, r) for r in b.receiver.poll())
        time.sleep(0.0005)
    return got_s, got_r


@pytest.fixture
def pd():
    p, ppool = make(40, seed=1)
    d, dpool = make(64, seed=2)
    p.add_peer(d.metadata().to_bytes())
    yield p, ppool, d, dpool
    p.close()
    d.close()


def test_batches_to_scattered_blocks_are_byte_identical(pd):
    p, ppool, d, dpool = pd
    before = dpool.clone()
    remote = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:30].tolist()
    local = torch.randperm(40, generator=torch.Generator().manual_seed(4))[:30].tolist()
    pairs = list(zip(local, remote))
    d.receiver.expect("r", remote, deadline=time.monotonic() + 10)
    for i in range(0, 30, 7):
        p.sender.send("r", d.agent_name, pairs[i : i + 7], final=i + 7 >= 30)
    sent, recv = drive([p, d], {"r"}, {"r"})
    assert sent["r"].status is TransferStatus.COMPLETE, sent["r"]
    assert recv["r"].status is TransferStatus.COMPLETE, recv["r"]
    assert recv["r"].num_bytes == 30 * d.metadata().block_bytes
    assert torch.equal(dpool[remote], ppool[local])
    untouched = sorted(set(range(64)) - set(remote))
    assert torch.equal(dpool[untouched], before[untouched])
    assert p.sender.num_outstanding_writes == 0


def test_incompatible_peer_is_refused_before_any_transfer(pd):
    p, _, _, _ = pd
    other, _ = make(8, seed=5, dtype=torch.float16)
    try:
        with pytest.raises(IncompatiblePeerError, match="dtype: ours='float32' theirs='float16'"):
            p.add_peer(other.metadata().to_bytes())
        assert other.agent_name not in p.peers()
    finally:
        other.close()


def test_metadata_that_nixl_cannot_use_is_a_clear_error(pd):
    p, _, d, _ = pd
    good = json.loads(d.metadata().to_bytes())
    bad_blob = dict(good, agent_name="someone-else")
    with pytest.raises(MetadataError, match="its NIXL blob is"):
        p.add_peer(json.dumps(bad_blob).encode())
    meta = d.metadata()
    garbage = PeerMetadata(
        **{
            **{f: getattr(meta, f) for f in meta.__slots__},
            "agent_name": "ghost",
            "agent_metadata": b"not nixl",
        }
    )
    with pytest.raises(MetadataError, match="NIXL refused"):
        p.add_peer(garbage)
    shifted = PeerMetadata(
        **{**{f: getattr(meta, f) for f in meta.__slots__}, "base_addr": meta.base_addr + 4096}
    )
    p.remove_peer(d.agent_name)
    with pytest.raises(MetadataError, match="not registered memory"):
        p.add_peer(shifted)
    assert p.peers() == []
    assert p.add_peer(d.metadata()) == d.agent_name  # the real metadata still works


def test_out_of_range_ids_never_reach_nixl(pd):
    p, _, d, dpool = pd
    before = dpool.clone()
    with pytest.raises(BlockRangeError):
        p.sender.send("r", d.agent_name, [(0, 64)], final=True)
    with pytest.raises(BlockRangeError):
        p.sender.send("r", d.agent_name, [(40, 0)], final=True)
    drive([p, d], set(), set(), timeout_s=0.05)
    assert torch.equal(dpool, before) and p.sender.num_active == 0


def test_ucx_net_devices_defaults_to_loopback(monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    b = NixlTransferBackend(KVTransferConfig(agent_name=f"env-{os.getpid()}"))
    try:
        assert os.environ["UCX_NET_DEVICES"] == "lo"
    finally:
        b.close()


@pytest.mark.gpu
def test_vram_pools_same_code():
    p, ppool = make(16, seed=1, device="cuda", dtype=torch.bfloat16)
    d, dpool = make(16, seed=2, device="cuda", dtype=torch.bfloat16)
    try:
        assert d.metadata().mem_type == "VRAM"
        p.add_peer(d.metadata().to_bytes())
        d.receiver.expect("g", [3, 7, 11])
        p.sender.send("g", d.agent_name, [(0, 3), (1, 7)], final=False)
        p.sender.send("g", d.agent_name, [(2, 11)], final=True)
        sent, recv = drive([p, d], {"g"}, {"g"})
        assert recv["g"].status is TransferStatus.COMPLETE
        assert torch.equal(dpool[[3, 7, 11]], ppool[[0, 1, 2]])
    finally:
        p.close()
        d.close()


def _quantized(blocks, seed, storage):
    """A pool as the engine stores it (engine/kv/kv_format.py): int8 rows carry their scales."""
    from engine.kv import kv_format

    g = torch.Generator().manual_seed(seed)
    values = (
        torch.randn((blocks, *SHAPE), generator=g)
        * torch.rand((blocks, *SHAPE[:-1], 1), generator=g)
        * 8
    )
    return kv_format.quantize(values, storage).contiguous()


@pytest.mark.parametrize(
    "kv_cache_dtype,storage",
    [("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)],
)
def test_quantized_blocks_arrive_byte_identical_with_their_scales(kv_cache_dtype, storage):
    """The scales live inside each block (int8: the last 4 bytes of every row), so a block
    written over NIXL dequantizes on the decode side exactly as on the prefill side."""
    from engine.kv import kv_format

    ppool, dpool = _quantized(12, 1, storage), torch.zeros_like(_quantized(20, 2, storage))
    assert ppool.shape[-1] == (68 if storage == torch.int8 else 64)
    backends = []
    try:
        for pool in (ppool, dpool):
            b = NixlTransferBackend(
                KVTransferConfig(agent_name=f"local-{os.getpid()}-{next(_count)}")
            )
            b.register_pool(pool, KVCompat.for_pool(pool, "m", kv_cache_dtype))
            backends.append(b)
        p, d = backends
        assert d.metadata().block_bytes == ppool[0].numel()  # one byte per element, scales included
        p.add_peer(d.metadata().to_bytes())
        local, remote = [3, 0, 11, 7], [19, 4, 5, 12]
        d.receiver.expect("q", remote, deadline=time.monotonic() + 10)
        p.sender.send("q", d.agent_name, list(zip(local, remote)), final=True)
        sent, recv = drive([p, d], {"q"}, {"q"})
        assert (
            sent["q"].status is TransferStatus.COMPLETE
            and recv["q"].status is TransferStatus.COMPLETE
        )
        assert torch.equal(dpool[remote].view(torch.uint8), ppool[local].view(torch.uint8))
        assert torch.equal(
            kv_format.dequantize(dpool[remote], 64, torch.float32),
            kv_format.dequantize(ppool[local], 64, torch.float32),
        )
        assert not dpool[[0, 1, 2]].view(torch.uint8).any()  # untouched blocks untouched
    finally:
        for b in backends:
            b.close()


def test_a_peer_of_another_kv_format_is_refused_naming_both():
    pools = (_quantized(4, 1, torch.float8_e4m3fn), _quantized(4, 2, torch.int8))
    backends = []
    try:
        for pool, kv in zip(pools, ("fp8", "int8")):
            b = NixlTransferBackend(
                KVTransferConfig(agent_name=f"local-{os.getpid()}-{next(_count)}")
            )
            b.register_pool(pool, KVCompat.for_pool(pool, "m", kv))
            backends.append(b)
        p, d = backends
        with pytest.raises(
            IncompatiblePeerError, match=r"ours fp8_e4m3 \(float8_e4m3fn.*theirs int8 \(int8"
        ):
            p.add_peer(d.metadata().to_bytes())
        assert d.agent_name not in p.peers()
    finally:
        for b in backends:
            b.close()


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_a_pool_freed_and_reallocated_is_registered_again(pd, side):
    """Sleep mode: a worker deregisters its pool before the memory is freed and registers
    the reallocated one (new address, new metadata); writes land in the new pool."""
    p, ppool, d, dpool = pd
    b, pool = (d, dpool) if side == "decode" else (p, ppool)
    compat = b.metadata().compat
    b.deregister_pool()
    fresh = torch.randn_like(pool) if side == "prefill" else torch.zeros_like(pool)
    meta = b.register_pool(fresh, compat)
    assert meta.base_addr == fresh.data_ptr()
    if side == "decode":
        dpool = fresh
        p.add_peer(meta.to_bytes())  # the next Prefill carries it: reconnect
    else:
        ppool = fresh
    d.receiver.expect("r", [5, 9], deadline=time.monotonic() + 10)
    p.sender.send("r", d.agent_name, [(1, 5), (2, 9)], final=True)
    sent, recv = drive([p, d], {"r"}, {"r"})
    assert sent["r"].status is TransferStatus.COMPLETE, sent["r"]
    assert recv["r"].status is TransferStatus.COMPLETE, recv["r"]
    assert torch.equal(dpool[5], ppool[1]) and torch.equal(dpool[9], ppool[2])
