"""Placement across weight updates: a worker's block hashes include its weights version
(published in its registration), so the router hashes a prompt per version, drops a
worker's index entries when it republishes a new version, never pairs a prefill and a decode
worker of different versions, and never places on a sleeping worker."""

import dataclasses

from cluster.registration import Capacity, WorkerInfo
from engine.kv.block_hash import compute_block_hashes
from router.config import PlacementConfig
from router.placement.events import KVSubscriptions
from router.placement.index import KVIndex
from router.placement.placer import Placer, PromptKey
from router.placement.policy import AffinityPolicy, Reason
from router.placement.registry import WorkerRegistry

IDS = list(range(200))
REMOTE = PlacementConfig(local_prefill_threshold=0, local_prefill_max_tokens=0)


def info(wid, role, version=0, **kw):
    return WorkerInfo(
        worker_id=wid,
        role=role,
        grpc_address=f"{wid}:1",
        model_id="m",
        compat_hash="c",
        block_size=16,
        weights_version=version,
        capacity=Capacity(total_blocks=1000, free_blocks=1000, prefill_tokens_per_s=1000.0),
        **kw,
    )


def test_registration_carries_version_and_sleeping():
    i = info("d", "decode", 3, sleeping=True)
    back = WorkerInfo.from_json(i.to_json())
    assert back.weights_version == 3 and back.sleeping
    old = i.to_json().replace(b',"weights_version":3', b"").replace(b',"sleeping":true', b"")
    assert WorkerInfo.from_json(old).weights_version == 0  # a worker from before


def test_prompt_hashes_per_weights_version():
    key = PromptKey(IDS)
    assert key.hashes(16, "auto", 0) == compute_block_hashes(IDS[:192], 16)
    assert key.hashes(16, "auto", 2) == compute_block_hashes(IDS[:192], 16, weights_version=2)
    assert key.hashes(16, "auto", 1)[0] != key.hashes(16, "auto", 2)[0]


def test_a_new_version_drops_the_workers_old_entries():
    registry, index = WorkerRegistry(), KVIndex()
    subs = KVSubscriptions(index, channels=None)
    registry.add_weights_listener(subs.on_new_weights)
    registry.put(info("d", "decode"))
    key = PromptKey(IDS)
    index.stored("d", key.hashes(16)[:8])
    placer = Placer(registry, index, AffinityPolicy(PlacementConfig()))
    assert placer._candidates(key)(registry.get("d")).cached_tokens == 128
    registry.put(dataclasses.replace(info("d", "decode", 1), updated_at=1.0))
    assert index.num_blocks("d") == 0
    index.stored("d", key.hashes(16, "auto", 1)[:4])  # cached again under the new version
    assert placer._candidates(key)(registry.get("d")).cached_tokens == 64


def test_workers_of_other_weights_do_not_pair_and_sleepers_get_nothing():
    registry = WorkerRegistry()
    registry.put(info("d", "decode", 1))
    registry.put(info("p", "prefill", 0))
    placer = Placer(registry, KVIndex(), AffinityPolicy(REMOTE))
    decision = placer.place(PromptKey(IDS)).decision
    assert decision.prefill is None and decision.reason is Reason.LOCAL_NO_PREFILL
    registry.put(info("p", "prefill", 1))
    assert placer.place(PromptKey(IDS)).decision.prefill.worker_id == "p"
    registry.put(info("d", "decode", 1, sleeping=True))
    assert placer.place(PromptKey(IDS)) is None
