"""Coalesced transfer plans (kvtransfer/coalesce.py, heads.slice_descs) and the descriptor
histograms (vLLM's `vllm:nixl_*` names) — no NIXL needed."""

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvtransfer.coalesce import by_source, coalesce, count_runs
from kvtransfer.heads import HeadRange, PoolGeometry, plan_slices, slice_descs
from kvtransfer.metrics import TransferMetrics


def descs(*rows):
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def test_pairs_contiguous_on_both_sides_merge_into_one_region():
    src = descs((100, 10, 0), (110, 10, 0), (120, 10, 0), (500, 10, 0))
    dst = descs((0, 10, 0), (10, 10, 0), (20, 10, 0), (30, 10, 0))
    s, d = coalesce(src, dst)
    assert s.tolist() == [[100, 30, 0], [500, 10, 0]]
    assert d.tolist() == [[0, 30, 0], [30, 10, 0]]


def test_pairs_contiguous_on_one_side_only_or_across_devices_stay_apart():
    src = descs((0, 8, 0), (8, 8, 0), (16, 8, 1))
    dst = descs((0, 8, 0), (100, 8, 0), (108, 8, 0))
    s, d = coalesce(src, dst)
    assert len(s) == len(d) == 3


def test_mismatched_plans_are_refused():
    with pytest.raises(ValueError, match="lengths differ"):
        coalesce(descs((0, 8, 0), (8, 8, 0)), descs((0, 8, 0), (8, 4, 0)))
    with pytest.raises(ValueError, match="destinations"):
        coalesce(descs((0, 8, 0)), descs())


def test_block_pairs_are_ordered_by_source_and_their_runs_counted():
    local, remote = by_source(np.array([7, 5, 6, 1]), np.array([12, 10, 11, 30]))
    assert local.tolist() == [1, 5, 6, 7] and remote.tolist() == [30, 10, 11, 12]
    assert count_runs(local, remote) == 2
    assert count_runs(np.array([1, 2, 3]), np.array([5, 7, 8])) == 2
    assert count_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == 0


GEO = PoolGeometry(base_addr=1 << 20, num_heads=3, device_id=0, rows=8, head_bytes=32)


def test_a_run_of_whole_blocks_is_one_descriptor_in_any_pair_order():
    (whole,) = plan_slices([HeadRange(0, 3)], [HeadRange(0, 3)])
    local, remote = np.array([9, 7, 8, 3]), np.array([22, 20, 21, 40])
    src, dst = slice_descs(whole, GEO, GEO, local, remote)
    bb = GEO.block_bytes
    assert src.tolist() == [[GEO.base_addr + 3 * bb, bb, 0], [GEO.base_addr + 7 * bb, 3 * bb, 0]]
    assert dst.tolist() == [[GEO.base_addr + 40 * bb, bb, 0], [GEO.base_addr + 20 * bb, 3 * bb, 0]]


def test_a_head_slice_is_one_piece_per_block():
    dst_geo = PoolGeometry(1 << 30, 2, 0, 8, 32)
    slices = plan_slices([HeadRange(0, 3)], [HeadRange(0, 2), HeadRange(2, 3)])
    s = next(x for x in slices if x.dst_rank == 0)
    src, dst = slice_descs(s, GEO, dst_geo, np.array([1, 2]), np.array([5, 6]))
    # Heads first in a block: heads 0-1 of a block are one region; adjacent blocks do not
    # merge (head 2 of block 1 lies between them in the source pool).
    assert len(src) == len(dst) == 2
    hr = GEO.rows * 32
    assert src.tolist() == [
        [GEO.base_addr + 1 * GEO.block_bytes, 2 * hr, 0],
        [GEO.base_addr + 2 * GEO.block_bytes, 2 * hr, 0],
    ]
    assert dst.tolist() == [
        [(1 << 30) + 5 * 2 * hr, 2 * hr, 0],
        [(1 << 30) + 6 * 2 * hr, 2 * hr, 0],
    ]
    t = next(x for x in slices if x.dst_rank == 1)  # head 2 -> the one head of rank 1's pool
    src, dst = slice_descs(t, GEO, PoolGeometry(0, 1, 0, 8, 32), np.array([1, 2]), np.array([5, 6]))
    assert src[:, 0].tolist() == [
        GEO.base_addr + GEO.block_bytes + 2 * hr,
        GEO.base_addr + 2 * GEO.block_bytes + 2 * hr,
    ]
    assert dst.tolist() == [[5 * hr, hr, 0], [6 * hr, hr, 0]]


def test_a_sender_exports_vllms_nixl_histograms_and_a_receiver_none():
    send, receive = TransferMetrics("send"), TransferMetrics("receive")
    send.label_vllm("m", "prefill")  # as the worker's metrics do: vLLM's labels
    send.record_post(3, 4096, 0.0002)
    send.record_post(1, 1024, 0.0001)
    send.record_batch("peer", 4, 5120, 0.002)
    registry = CollectorRegistry()
    registry.register(send.registry)
    registry.register(receive.registry)  # no name registered twice
    text = generate_latest(registry).decode()
    counts = {
        "vllm:nixl_num_descriptors": 2,  # per post
        "vllm:nixl_bytes_transferred": 2,
        "vllm:nixl_post_time_seconds": 2,
        "vllm:nixl_xfer_time_seconds": 1,  # per completed batch
    }
    labels = {"model_name": "m", "engine": "0", "role": "prefill"}
    for name, count in counts.items():
        assert f"# TYPE {name} histogram" in text
        assert registry.get_sample_value(f"{name}_count", labels) == count, name
    assert registry.get_sample_value("vllm:nixl_num_descriptors_sum", labels) == 4
    bucket = {**labels, "le": "1.0"}
    assert registry.get_sample_value("vllm:nixl_num_descriptors_bucket", bucket) == 1
    assert send.transfers.transfers == 2
    assert (send.transfers.descriptors, send.transfers.bytes) == (4, 5120)
    assert receive.transfers.transfers == 0
