"""A registration is checked whole before any of it is used (cluster/registration_check.py):
every field's type, range and length, its agreement with its etcd key; one that does not fit
is refused (InvalidRegistration naming the field), never half-used."""

import copy
import json
import logging

import pytest

from cluster.registration import (
    Capacity,
    WorkerInfo,
    parse_registration,
    workers_prefix,
)
from cluster.registration_check import InvalidRegistration, check_registration


def _doc() -> dict:
    info = WorkerInfo(
        "decode-10.0.0.5-50051",
        "decode",
        "10.0.0.5:50051",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "0123abcd",
        16,
        kv_metadata=json.dumps({"version": 1, "agent_name": "D", "agent_metadata": "bWV0YQ=="}),
        metrics_address="10.0.0.5:9100",
        capacity=Capacity(total_blocks=1000, free_blocks=900, prefill_tokens_per_s=1234.5),
        updated_at=1.7e9,
        max_model_len=8192,
        loras={"sql": "/adapters/sql"},
        resident_loras=("sql",),
        weights_version=3,
        block_hash_probe="ab" * 16,
    )
    return json.loads(info.to_json())


def _parse(doc, key=("decode", "decode-10.0.0.5-50051")) -> WorkerInfo:
    return WorkerInfo.from_json(json.dumps(doc).encode(), key)


def test_a_registration_a_worker_writes_parses_back_equal():
    doc = _doc()
    info = _parse(doc)
    assert json.loads(info.to_json()) == doc
    for address in ("[fd00::5]:1", "::1:50051", "worker-3.pods.svc:50051"):
        assert _parse({**doc, "grpc_address": address}).grpc_address == address


def test_the_transfer_self_test_result_is_accepted_in_its_shape():
    selftest = {"gbps": 11.5, "memcpy_gbps": 20.0, "ratio": 0.575, "path": "cuda_ipc"}
    info = _parse({**_doc(), "transfer_selftest": selftest})
    assert info.worker_id == "decode-10.0.0.5-50051"
    _parse({**_doc(), "transfer_selftest": None})
    for bad in (
        {**selftest, "gbps": -1},
        {**selftest, "ratio": "fast"},
        {**selftest, "path": "x" * 513},
        {**selftest, "path": "failed: a\nb"},
        {**selftest, "extra": 1},
        {"gbps": 1.0},
        [1, 2],
    ):
        with pytest.raises(InvalidRegistration, match="transfer_selftest"):
            _parse({**_doc(), "transfer_selftest": bad})


def test_what_a_worker_publishes_of_its_self_test_passes_every_readers_check():
    """The paths the self-test really reports (UCX's transports and settings in words, ~80
    characters; a failure's multi-line reason) once made every worker's registration invalid
    to every reader: no peers, no disaggregation. Published, they always fit."""
    from dataclasses import asdict

    from cluster.registration import TransferSelftest
    from kvtransfer.selftest import describe_path

    real = describe_path("nixl", "DRAM", transports=["cma/memory", "tcp/lo"])
    failed = "failed: UCX said\n" + "x" * 2000
    for path in (real, failed):
        published = TransferSelftest.published(9.5, 16.0, 0.59, path)
        info = _parse({**_doc(), "transfer_selftest": asdict(published)})
        assert info.transfer_selftest == published
    assert TransferSelftest.published(1, 2, 0.5, real).path == real
    assert len(real) > 64


def _set(path: str, value):
    def change(doc):
        *parents, last = path.split(".")
        target = doc
        for p in parents:
            target = target[p]
        target[last] = value

    return change


def _drop(name):
    return lambda doc: doc.pop(name)


BAD = {
    "negative total blocks": (_set("capacity.total_blocks", -1), "capacity.total_blocks"),
    "huge total blocks": (_set("capacity.total_blocks", 1 << 60), "capacity.total_blocks"),
    "free above total": (_set("capacity.free_blocks", 5000), "free_blocks exceeds"),
    "string count": (_set("capacity.running", "3"), "capacity.running"),
    "bool count": (_set("block_size", True), "block_size"),
    "float count": (_set("max_model_len", 8192.5), "max_model_len"),
    "zero block size": (_set("block_size", 0), "block_size"),
    "NaN rate": (_set("capacity.prefill_tokens_per_s", float("nan")), "prefill_tokens_per_s"),
    "infinite time": (_set("updated_at", float("inf")), "updated_at"),
    "negative version": (_set("weights_version", -2), "weights_version"),
    "address without port": (_set("grpc_address", "10.0.0.5"), "grpc_address"),
    "port out of range": (_set("grpc_address", "10.0.0.5:70000"), "grpc_address"),
    "URL as address": (_set("grpc_address", "http://evil:80/x"), "grpc_address"),
    "address with a space": (_set("grpc_address", "evil host:1"), "grpc_address"),
    "bracketed IPv4": (_set("grpc_address", "[10.0.0.5]:1"), "grpc_address"),
    "bad metrics address": (_set("metrics_address", "x:0"), "metrics_address"),
    "address not text": (_set("grpc_address", 5), "grpc_address"),
    "slash in worker id": (_set("worker_id", "a/b"), "worker_id"),
    "long worker id": (_set("worker_id", "w" * 256), "worker_id"),
    "unknown role": (_set("role", "router"), "role"),
    "long model id": (_set("model_id", "m" * 1025), "model_id"),
    "control characters": (_set("compat_hash", "a\x1b[2Jb"), "compat_hash"),
    "metadata not ASCII": (_set("kv_metadata", '{"agent": "\u00e9"}'), "kv_metadata"),
    "metadata with a newline": (_set("kv_metadata", '{"a":\n1}'), "kv_metadata"),
    "metadata too long": (_set("kv_metadata", "A" * ((2 << 20) + 4)), "kv_metadata"),
    "draining as a string": (_set("draining", "yes"), "draining"),
    "capacity not an object": (_set("capacity", [1]), "capacity"),
    "many unknown capacity fields": (
        _set("capacity", {f"x{i}": 1 for i in range(40)}),
        "unknown fields",
    ),
    "unknown capacity field not a number": (_set("capacity.newer", "x"), "capacity.newer"),
    "too many LoRAs": (_set("loras", {f"a{i}": "/p" for i in range(1025)}), "loras"),
    "LoRA name with a slash": (_set("loras", {"../x": "/p"}), "LoRA name"),
    "resident LoRAs not a list": (_set("resident_loras", "sql"), "resident_loras"),
    "unknown top-level field": (_set("callback_url", "http://evil"), "unknown fields"),
    "missing address": (_drop("grpc_address"), "grpc_address is missing"),
    "missing block size": (_drop("block_size"), "block_size is missing"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_registration_that_does_not_fit_is_refused_naming_the_field(case):
    change, message = BAD[case]
    doc = copy.deepcopy(_doc())
    change(doc)
    with pytest.raises(InvalidRegistration, match=message.replace(".", r"\.")):
        _parse(doc)


def test_a_registration_must_agree_with_its_key():
    with pytest.raises(InvalidRegistration, match="its key names decode/other"):
        _parse(_doc(), key=("decode", "other"))
    with pytest.raises(InvalidRegistration, match="its key names prefill/"):
        _parse(_doc(), key=("prefill", "decode-10.0.0.5-50051"))


@pytest.mark.parametrize(
    "data", [b"[]", b"{", b"\xff\xfe", b"[" * 100_000, b" " * (4 << 20) + b"{}"]
)
def test_what_is_not_a_json_object_of_bounded_size_is_refused(data):
    with pytest.raises(InvalidRegistration):
        WorkerInfo.from_json(data)


def test_check_registration_refuses_other_types():
    with pytest.raises(InvalidRegistration, match="JSON object"):
        check_registration("worker")


def test_parse_registration_logs_the_key_and_uses_nothing(caplog):
    prefix = workers_prefix("c")
    doc = _doc()
    doc["capacity"]["total_blocks"] = -5
    with caplog.at_level(logging.WARNING):
        info = parse_registration(
            prefix + b"decode/decode-10.0.0.5-50051", json.dumps(doc).encode(), prefix
        )
    assert info is None
    assert "/pdserve/c/workers/decode/decode-10.0.0.5-50051" in caplog.text
    assert "capacity.total_blocks" in caplog.text
    good = parse_registration(
        prefix + b"decode/decode-10.0.0.5-50051", json.dumps(_doc()).encode(), prefix
    )
    assert good is not None and good.capacity.total_blocks == 1000
