"""Capacity documents in etcd: the step timings and budgets placement needs travel with a
registration, and documents of older and newer workers still parse (pure: no etcd)."""

import json

from cluster.registration import Capacity, WorkerInfo

MEASURED = Capacity(
    total_blocks=20,
    free_blocks=7,
    running=3,
    waiting=1,
    queued_prefill_tokens=300,
    prefill_tokens_per_s=1234.5,
    decode_step_s=0.04,
    decode_step_tokens=3.0,
    prefill_step_s=0.2,
    prefill_step_tokens=259.0,
    max_num_batched_tokens=2048,
    long_prefill_token_threshold=256,
)


def _info(capacity: Capacity) -> WorkerInfo:
    return WorkerInfo("w1", "decode", "127.0.0.1:1", "m", "hash", 16, capacity=capacity)


def test_step_timings_round_trip():
    assert WorkerInfo.from_json(_info(MEASURED).to_json()).capacity == MEASURED


def test_an_older_workers_document_reads_as_unmeasured():
    doc = json.loads(_info(MEASURED).to_json())
    doc["capacity"] = {
        "total_blocks": 20,
        "free_blocks": 7,
        "running": 3,
        "waiting": 1,
        "queued_prefill_tokens": 300,
        "prefill_tokens_per_s": 1234.5,
    }
    cap = WorkerInfo.from_json(json.dumps(doc).encode()).capacity
    assert (cap.free_blocks, cap.prefill_tokens_per_s) == (7, 1234.5)
    assert (
        cap.decode_step_s,
        cap.prefill_step_s,
        cap.max_num_batched_tokens,
        cap.long_prefill_token_threshold,
    ) == (0.0, 0.0, 0, 0)
    doc.pop("capacity")
    assert WorkerInfo.from_json(json.dumps(doc).encode()).capacity == Capacity()


def test_a_newer_workers_unknown_capacity_fields_are_ignored():
    doc = json.loads(_info(MEASURED).to_json())
    doc["capacity"]["some_future_measurement"] = 1.5
    assert WorkerInfo.from_json(json.dumps(doc).encode()).capacity == MEASURED


def test_the_dataclass_and_the_proto_message_have_the_same_fields():
    """Health answers `pb.Capacity(**asdict(capacity))`: a field added to one only breaks it."""
    from dataclasses import asdict, fields

    from proto import pdserve_pb2 as pb

    assert {f.name for f in fields(Capacity)} == set(pb.Capacity.DESCRIPTOR.fields_by_name)
    assert pb.Capacity(**asdict(MEASURED)).prefill_tokens_per_s == MEASURED.prefill_tokens_per_s
