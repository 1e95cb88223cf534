"""KV index: events, eviction, snapshots, tiers, and hashes equal to the engine's by
construction."""

import random

import engine.kv.block_hash
import router.placement.index
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import RunnerOutput
from engine.kv.block_hash import compute_block_hashes, hash_extras
from engine.kv.block_manager import BlockManager
from engine.processing.tokens import SampledToken
from engine.sampling.sampling_params import SamplingParams
from router.placement.index import KVIndex, PrefixHit, prompt_block_hashes

BS = 4


def blocks(match: dict[str, PrefixHit]) -> dict[str, int]:
    """Leading blocks per worker, tiers aside."""
    return {w: hit.blocks for w, hit in match.items()}


def hashes(tokens, salt=None):
    return compute_block_hashes(tokens, BS, salt)


def test_longest_prefix_per_worker():
    idx = KVIndex()
    h = hashes(list(range(40)))  # 10 blocks
    idx.stored("a", h[:10])
    idx.stored("b", h[:4])
    idx.stored("c", h[1:6])  # no first block: no prefix at all
    idx.stored("d", h[:2] + h[3:8])  # a gap after two blocks
    assert blocks(idx.match(h)) == {"a": 10, "b": 4, "d": 2}
    assert blocks(idx.match(h[:3])) == {"a": 3, "b": 3, "d": 2}
    assert blocks(idx.match([])) == {}
    assert idx.match(hashes(list(range(100, 140)))) == {}
    assert len(idx) == 10 and idx.num_blocks("d") == 7


def test_eviction_cuts_the_prefix_and_forgets_unheld_blocks():
    idx = KVIndex()
    h = hashes(list(range(32)))
    idx.stored("a", h)
    idx.stored("b", h[:2])
    idx.removed("a", [h[5], h[7]])
    assert blocks(idx.match(h)) == {"a": 5, "b": 2}
    idx.removed("a", h[5:])  # removing what is already gone is harmless
    idx.removed("a", [h[0]])
    assert blocks(idx.match(h)) == {"b": 2}
    idx.removed("b", h[:2])
    assert blocks(idx.match(h)) == {} and len(idx) == 4  # h[1..4] still held by a
    idx.removed("nobody", h)


def test_snapshot_reset_and_worker_removal_reuse_slots():
    idx = KVIndex()
    h = hashes(list(range(24)))
    idx.stored("a", h)
    idx.stored("b", h[:3])
    idx.reset("a", h[:1])  # snapshot: only the first block now
    assert blocks(idx.match(h)) == {"a": 1, "b": 3}
    idx.remove_worker("b")
    assert blocks(idx.match(h)) == {"a": 1} and idx.workers() == ["a"]
    idx.stored("c", h[:6])  # takes b's freed slot; b's old bits must not leak into c
    assert blocks(idx.match(h)) == {"a": 1, "c": 6}
    idx.remove_worker("a")
    idx.remove_worker("c")
    assert len(idx) == 0 and blocks(idx.match(h)) == {}


def test_cache_salt_separates_tenants():
    idx = KVIndex()
    tokens = list(range(20))
    idx.stored("a", prompt_block_hashes(tokens, BS, "tenant-1"))
    assert blocks(idx.match(prompt_block_hashes(tokens, BS, "tenant-1"))) == {"a": 4}
    assert blocks(idx.match(prompt_block_hashes(tokens, BS, "tenant-2"))) == {}
    assert blocks(idx.match(prompt_block_hashes(tokens, BS))) == {}
    # An empty salt means no salt (the workers read "" the same way).
    assert prompt_block_hashes(tokens, BS, "") == prompt_block_hashes(tokens, BS, None)


def test_hashes_are_the_engines_by_construction():
    assert router.placement.index.compute_block_hashes is engine.kv.block_hash.compute_block_hashes
    tokens = list(range(33))
    # Reusable blocks stop one token short of the prompt's end, as the engine's matching does.
    assert prompt_block_hashes(tokens, BS) == compute_block_hashes(tokens, BS)[:8]
    assert prompt_block_hashes(tokens[:32], BS) == compute_block_hashes(tokens, BS)[:7]
    assert prompt_block_hashes([], BS) == []


def _request(rid, tokens, salt=None):
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling=SamplingParams(max_tokens=2, temperature=0.0),
        seed=0,
        eos_token_ids=frozenset(),
        max_tokens=2,
        block_hashes=compute_block_hashes(tokens, BS, salt),
        hash_extras=hash_extras(salt),
        cache_salt=salt,
    )


def _run(scheduler, requests):
    for r in requests:
        scheduler.add_request(r)
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        scheduler.update_from_output(
            out,
            RunnerOutput(
                {
                    r.request_id: [SampledToken(7)]
                    for r, n in out.scheduled
                    if r.num_computed_tokens + n == r.num_tokens
                }
            ),
        )


def test_index_fed_by_a_real_block_manager_predicts_its_prefix_hits():
    """Events from the engine's own block manager (stores, then LRU evictions in a small pool)
    keep the index equal to what the block manager would match."""
    bm = BlockManager(12, BS, record_events=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    idx = KVIndex()

    def apply_events():
        for e in bm.pool.take_events():
            (idx.stored if e.stored else idx.removed)("w", [e.block_hash])

    shared = list(range(1000, 1020))  # 5 blocks
    _run(sched, [_request("r1", shared + [1, 2, 3])])
    apply_events()
    probe = shared + [9, 9]
    predicted = blocks(idx.match(prompt_block_hashes(probe, BS))).get("w", 0)
    assert predicted * BS == bm.match_prefix(_request("probe", probe)).num_tokens == 20

    _run(sched, [_request("r2", list(range(2000, 2040)))])  # 10 blocks: evicts most of r1's
    apply_events()
    assert bm.match_prefix(_request("probe", probe)).num_tokens < 20  # evictions happened
    for tokens in (probe, list(range(2000, 2040)) + [5]):
        predicted = blocks(idx.match(prompt_block_hashes(tokens, BS))).get("w", 0)
        assert predicted * BS == bm.match_prefix(_request("probe", tokens)).num_tokens
    assert len(idx) == len(bm.pool.cached_hashes())
    assert set(idx.blocks_of("w")) == set(bm.pool.cached_hashes())


def test_a_block_moving_between_pool_and_tier_keeps_its_holder_and_counts_its_tier():
    idx = KVIndex()
    h = hashes(list(range(24)))  # 6 blocks
    idx.stored("a", h)
    idx.stored("b", h[:4], [0, 0, 1, 1])
    assert idx.match(h) == {"a": PrefixHit(6, 0), "b": PrefixHit(4, 2)}
    idx.stored("a", h[4:], [1, 1])  # demoted: still held, now in the tier
    assert idx.match(h)["a"] == (6, 2) and idx.match(h[:5])["a"] == (5, 1)
    idx.stored("a", [h[5]])  # promoted back (no tiers sent: the pool)
    assert idx.match(h)["a"] == (6, 1)
    idx.stored("a", [h[0]], [1])  # a root in the tier counts like any other block
    assert idx.match(h)["a"] == (6, 2)
    idx.removed("a", [h[4]])  # dropped by the full tier: held nowhere
    assert idx.match(h) == {"a": PrefixHit(4, 1), "b": PrefixHit(4, 2)}
    idx.reset("b", h[:2], [1, 0])  # a snapshot replaces tiers too
    assert idx.match(h)["b"] == (2, 1)
    idx.remove_worker("b")
    idx.remove_worker("a")
    assert len(idx) == 0 and not idx._tiered


def _reference_match(held: dict[str, dict], h: list) -> dict[str, PrefixHit]:
    out = {}
    for w, mine in held.items():
        n = 0
        while n < len(h) and h[n] in mine:
            n += 1
        if n:
            out[w] = PrefixHit(n, sum(1 for x in h[:n] if mine[x]))
    return out


def test_random_event_sequences_match_a_reference_model():
    """Stores (either tier), removals, snapshots and worker removals in random order: every
    match equals the one a plain dict of (worker -> hash -> tier) gives."""
    chains = [hashes(list(range(base, base + 32))) for base in (0, 1000)]  # two 8-block prompts
    prompt = chains[0] + chains[1][:3]  # a prompt that shares nothing past chain 0
    pool = chains[0] + chains[1]
    for seed in range(20):
        rng = random.Random(seed)
        idx, held = KVIndex(), {}
        for _ in range(150):
            w = rng.choice("abcde")
            some = rng.sample(pool, rng.randint(0, 6))
            op = rng.random()
            if op < 0.45:
                tiers = [rng.randint(0, 1) for _ in some]
                idx.stored(w, some, tiers)
                held.setdefault(w, {}).update(zip(some, tiers))
            elif op < 0.8:
                idx.removed(w, some)
                for x in some:
                    held.get(w, {}).pop(x, None)
            elif op < 0.92:
                tiers = [rng.randint(0, 1) for _ in some]
                idx.reset(w, some, tiers)
                held[w] = dict(zip(some, tiers))
            else:
                idx.remove_worker(w)
                held.pop(w, None)
            for probe in (prompt, chains[1], chains[0][:3]):
                assert idx.match(probe) == _reference_match(held, probe), seed
        assert len(idx) == len(set().union(*map(set, held.values())) if held else set())
