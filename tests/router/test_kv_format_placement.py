"""Placement with quantized KV caches: a worker's block hashes include its KV cache dtype
(published in its registration), so the router hashes a prompt per format; workers of one
format share hashes; a prefill worker pairs only with decode workers of its KV layout."""

import logging

from cluster.registration import Capacity, WorkerInfo
from engine.kv.block_hash import compute_block_hashes
from router.config import PlacementConfig
from router.placement.index import KVIndex
from router.placement.placer import Placer, PromptKey
from router.placement.policy import AffinityPolicy, Reason
from router.placement.registry import WorkerRegistry

IDS = list(range(200))


def info(wid, role, kv="auto", compat=None):
    return WorkerInfo(
        worker_id=wid,
        role=role,
        grpc_address=f"{wid}:1",
        model_id="m",
        compat_hash=compat or f"compat-{kv}",
        block_size=16,
        kv_cache_dtype=kv,
        capacity=Capacity(total_blocks=1000, free_blocks=1000, prefill_tokens_per_s=1000.0),
    )


def test_registration_carries_the_kv_cache_dtype():
    i = info("d", "decode", "int8")
    assert WorkerInfo.from_json(i.to_json()).kv_cache_dtype == "int8"
    old = i.to_json().replace(b',"kv_cache_dtype":"int8"', b"")  # a worker from before
    assert WorkerInfo.from_json(old).kv_cache_dtype == "auto"


def test_prompt_hashes_per_kv_format():
    key = PromptKey(IDS)
    assert key.hashes(16) == compute_block_hashes(IDS[:192], 16)
    assert key.hashes(16, "fp8_e4m3") == compute_block_hashes(
        IDS[:192], 16, kv_cache_dtype="fp8_e4m3"
    )
    assert (
        len({bytes(key.hashes(16, kv)[0]) for kv in ("auto", "fp8_e4m3", "fp8_e5m2", "int8")}) == 4
    )


def test_prefix_affinity_matches_each_worker_with_its_own_format():
    registry, index = WorkerRegistry(), KVIndex()
    for wid, kv in (("d-auto", "auto"), ("d-fp8", "fp8_e4m3"), ("d-fp8b", "fp8_e4m3")):
        registry.put(info(wid, "decode", kv))
    key = PromptKey(IDS)
    # every worker caches the prompt's first 8 blocks, hashed as its engine hashes them
    index.stored("d-auto", key.hashes(16)[:8])
    index.stored("d-fp8", key.hashes(16, "fp8_e4m3")[:8])
    index.stored("d-fp8b", key.hashes(16, "auto")[:8])  # auto hashes: not this worker's format
    placer = Placer(registry, index, AffinityPolicy(PlacementConfig()))
    cands = {s.info.worker_id: placer._candidates(PromptKey(IDS))(s) for s in registry.all()}
    assert cands["d-auto"].cached_tokens == 128 and cands["d-fp8"].cached_tokens == 128
    assert cands["d-fp8b"].cached_tokens == 0


def test_prefill_workers_of_another_kv_layout_are_not_paired(caplog):
    registry = WorkerRegistry()
    registry.put(info("d", "decode", "fp8_e4m3"))
    with caplog.at_level(logging.WARNING, logger="router.placement.registry"):
        registry.put(info("p-int8", "prefill", "int8"))
    assert (
        "p-int8 (prefill, KV int8, block size 16) shares its KV layout with no decode worker "
        "(d: KV fp8_e4m3, block size 16)" in caplog.text
    )
    placer = Placer(
        registry,
        KVIndex(),
        AffinityPolicy(PlacementConfig(local_prefill_threshold=0, local_prefill_max_tokens=0)),
    )
    decision = placer.place(PromptKey(IDS)).decision
    assert decision.prefill is None and decision.reason is Reason.LOCAL_NO_PREFILL
    registry.put(info("p-fp8", "prefill", "fp8_e4m3"))
    decision = placer.place(PromptKey(IDS)).decision
    assert decision.reason is Reason.REMOTE and decision.prefill.worker_id == "p-fp8"
