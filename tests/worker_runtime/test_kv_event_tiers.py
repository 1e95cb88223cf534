"""KV events and snapshots carry the tier (worker_runtime/kv_events.py kv_event_batch,
kv_snapshot): a router index fed by a real block manager with a second tier — its stream
and its snapshot — knows which blocks sit in the pool and which in the tier."""

from engine.kv.block_manager import BlockManager
from engine.kv.block_pool import KVEvent
from engine.kv.kv_tier import FakeTierStorage, KVTier
from proto import pdserve_pb2 as pb
from router.placement.index import KVIndex
from tests.engine.engine_factories import make_request
from tests.engine.test_kv_offload import run_once
from worker_runtime.kv_events import kv_event_batch, kv_snapshot

BS = 4


def _apply(index: KVIndex, batch: pb.KVEventBatch) -> None:
    """As router/placement/events.py applies a batch, through the wire format."""
    batch = pb.KVEventBatch.FromString(batch.SerializeToString())
    index.removed("w", batch.removed)
    index.stored("w", batch.stored, batch.stored_tiers)


def _truth(bm: BlockManager) -> dict[bytes, int]:
    pool, tier = bm.pool.held_hashes()
    return {**{h: 0 for h in pool}, **{h: 1 for h in tier}}


def test_one_batch_keeps_each_hashs_last_event_and_sends_tiers_only_when_needed():
    batch = kv_event_batch(
        [
            KVEvent(True, b"a"),
            KVEvent(True, b"a", tier=1),
            KVEvent(True, b"b"),
            KVEvent(False, b"c"),
            KVEvent(True, b"c", tier=1),
        ]
    )
    assert list(batch.stored) == [b"a", b"b", b"c"] and list(batch.stored_tiers) == [1, 0, 1]
    batch = kv_event_batch([KVEvent(True, b"a", tier=1), KVEvent(False, b"a"), KVEvent(True, b"b")])
    assert list(batch.removed) == [b"a"] and list(batch.stored) == [b"b"]
    assert not batch.stored_tiers  # all in the pool: the same bytes as a worker before tiers


def test_index_follows_demotions_promotions_and_tier_evictions():
    bm = BlockManager(6, BS, tier=KVTier(FakeTierStorage(4)), record_events=True)
    index = KVIndex()
    prompts = [list(range(base, base + 4 * BS + 1)) for base in (0, 100, 200, 0, 300, 100)]
    saw_tier = saw_promotion = False
    for tokens in prompts:
        run_once(bm, make_request(tokens, BS))
        events = bm.pool.take_events()
        saw_tier |= any(e.stored and e.tier for e in events)
        saw_promotion |= any(
            e.stored and not e.tier and bm.pool.tier.stats.promotions for e in events
        )
        _apply(index, kv_event_batch(events))
        truth = _truth(bm)
        assert index.blocks_of("w") == truth
        snapshot = pb.CachedBlocksResponse.FromString(
            kv_snapshot(*bm.pool.held_hashes()).SerializeToString()
        )
        rebuilt = KVIndex()
        rebuilt.reset("w", snapshot.block_hashes, snapshot.tiers)
        assert rebuilt.blocks_of("w") == truth
    assert saw_tier and saw_promotion and bm.pool.tier.stats.evictions  # every path was taken
    assert (
        bm.pool.tier.copy_times.load_s > 0
    )  # promotions are timed (Capacity.kv_promote_s_per_block)


def test_the_worker_publishes_its_tier_in_its_capacity(model_dir):
    import dataclasses
    from unittest import mock

    from cluster.grpc_security import OPEN
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from kvtransfer import FakeFabric, FakeTransferBackend, KVTransferConfig
    from worker_runtime.args import WorkerConfig
    from worker_runtime.runtime import WorkerRuntime

    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            num_layers=2,
            dtype="float32",
            kv_cache_memory=8 << 20,
            kv_offloading_size=4 << 20,
        )
    )
    runtime = WorkerRuntime(
        WorkerConfig(role="decode", etcd="unused:0"),
        engine,
        FakeTransferBackend(FakeFabric(), KVTransferConfig(agent_name="w")),
        lambda info: mock.AsyncMock(),
        auth=OPEN,
        metrics=mock.MagicMock(),
    )
    slots = engine.block_manager.pool.tier.num_slots
    cap = runtime.capacity()
    assert (cap.kv_offload_total_blocks, cap.kv_offload_used_blocks) == (slots, 0) and slots > 0
    # The engine times its tier's copies once at start; no pull has run here.
    assert cap.kv_promote_s_per_block > 0 and cap.kv_pull_blocks_per_s == 0
    runtime.stats = dataclasses.replace(
        runtime.stats, kv_offload_blocks_used=5, kv_offload_promote_s=2e-4
    )
    cap = runtime.capacity()
    assert (cap.kv_offload_used_blocks, cap.kv_promote_s_per_block) == (5, 2e-4)
    assert pb.Capacity(**dataclasses.asdict(cap)).kv_offload_total_blocks == slots
