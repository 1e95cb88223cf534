"""Part of benchmarks/kv_offload_bench.py (run that): what the KV tier costs and saves around
decode steps and preemption, each pair measured in the same run.

- decode step time, tier on vs off: two engines with the same pool, interleaved step by step;
  a filler prompt's cached blocks fill the pool first, so the decodes' growing tables evict
  them (demotions with the tier on, dropped with it off).
- a preempted --swap-tokens request resumed: swap (tier on: its full blocks promoted, its
  partial block swapped in, one token computed) vs recompute (tier off: every token again);
  its blocks are pushed out of the pool by a higher-priority filler while it waits.
- the tier's copies: one memmove per block vs torch index_select/index_copy_ (what
  engine/kv/kv_tier_storage.py `_gather_copy` does off the host), and tier stores about as long as a
  decode step run on a thread overlapped with it vs one after the other.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch


def _engines(args, pool_blocks: int, tier_blocks: int, **kw):
    from engine import LLM
    from engine.kv.kv_pool import kv_block_bytes

    probe = LLM(args.model, dtype=args.dtype, num_layers=args.num_layers, kv_cache_memory=1 << 24)
    e = probe.engine
    block_bytes = kv_block_bytes(e.loaded.args, args.block_size, e.dtype, e.config.kv_cache_dtype)
    vocab = e.loaded.args.vocab_size
    del probe, e
    common = dict(
        dtype=args.dtype,
        num_layers=args.num_layers,
        block_size=args.block_size,
        kv_cache_memory=pool_blocks * block_bytes,
        **kw,
    )
    off = LLM(args.model, **common)
    on = LLM(args.model, kv_offloading_size=tier_blocks * block_bytes, **common)
    return off, on, vocab


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    return [(seed * 7919 + 13 * i) % (vocab - 1000) + 500 for i in range(length)]


def decode_on_vs_off(args) -> None:
    from engine import SamplingParams

    bs, batch, prompt_len, steps = args.block_size, 4, 64, args.decode_steps
    pool = batch * -(-(prompt_len + steps) // bs) + 2
    off, on, vocab = _engines(args, pool, 4 * pool, max_num_seqs=batch)
    times: dict[str, list[float]] = {"off": [], "on": []}
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for rnd in range(3):  # round 0 warms up
        for llm in (off, on):  # cached blocks everywhere: the decodes evict them
            llm.generate(
                [_prompt(900 + rnd, (pool - 1) * bs - 1, vocab)],
                SamplingParams(max_tokens=1),
                use_tqdm=False,
            )
            for i in range(batch):
                llm.engine.add_request(
                    f"{rnd}-{i}", _prompt(100 * rnd + i, prompt_len, vocab), params
                )
        pair = [("off", off), ("on", on)]
        while off.engine.has_unfinished_requests() or on.engine.has_unfinished_requests():
            pair.reverse()  # neither engine always steps first
            for name, llm in pair:
                eng = llm.engine
                if not eng.has_unfinished_requests():
                    continue
                before = eng.scheduler.stats.prompt_tokens
                t = time.perf_counter()
                eng.step()
                dt = time.perf_counter() - t
                if rnd and eng.scheduler.stats.prompt_tokens == before:
                    times[name].append(dt)
    m_off, m_on = statistics.median(times["off"]), statistics.median(times["on"])
    demoted = on.engine.stats().kv_offload_demotions
    print(
        f"decode step, batch {batch}: tier off {m_off * 1e3:7.2f} ms, tier on {m_on * 1e3:7.2f} ms "
        f"(median of {len(times['on'])}; {demoted} demotions)  ratio on/off {m_on / m_off:5.3f}"
    )
    _copy_variants(on, 64)
    _overlap(on, vocab, batch)


def _copy_variants(llm, n: int) -> None:
    """64 scattered blocks pool -> tier slots: memmove per block vs index_select+index_copy_."""
    from engine.kv.kv_tier_storage import _gather_copy

    llm.engine.reset_prefix_cache()  # scratch copies below overwrite slots
    storage = llm.engine.block_manager.pool.tier.storage
    storage = getattr(storage, "inner", storage)
    pool, slots = storage.pool, storage.slots
    n = min(n, pool.shape[0], slots.shape[0])
    src = torch.randperm(pool.shape[0])[:n].tolist()
    dst = torch.randperm(slots.shape[0])[:n].tolist()
    si, di = torch.tensor(src), torch.tensor(dst)

    def gathered() -> None:
        slots.index_copy_(0, di, pool.index_select(0, si))

    res = {}
    for name, fn in (
        ("memmove/block", lambda: _gather_copy(slots, dst, pool, src)),
        ("index_select+index_copy_", gathered),
    ):
        fn()
        ts = []
        for _ in range(7):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        res[name] = statistics.median(ts)
    block = pool[0].numel() * pool.element_size()
    for name, sec in res.items():
        print(
            f"copy {n} blocks ({block / 1024:.0f} KiB each) {name:26s} {sec * 1e6 / n:7.1f} "
            f"us/block {n * block / sec / 1e9:6.2f} GB/s"
        )


def _overlap(llm, vocab: int, batch: int) -> None:
    """Tier stores sized to take about as long as a decode step, on a thread during the step
    vs after it: overlapped, the pair takes max(step, copy) if the copy finds idle cores,
    step + copy (or worse) if it competes with the forward for them."""
    from engine import SamplingParams

    eng = llm.engine
    storage = eng.block_manager.pool.tier.storage
    n = min(storage.num_slots, eng.block_manager.pool.num_blocks)
    slots, blocks = list(range(n)), list(range(n))  # scratch copies: bytes only, no bookkeeping
    for i in range(batch):
        eng.add_request(
            f"ov-{i}",
            _prompt(50 + i, 64, vocab),
            SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True),
        )
    for _ in range(3):
        eng.step()  # prefill and warm-up
    pool, tier_slots = storage.pool, storage.slots
    si, di = torch.tensor(blocks), torch.tensor(slots)
    variants = {  # the engine's host copy (memmove per block, a Python loop) and torch's
        "memmove/block": lambda: storage.store_many(slots, blocks),
        "index_copy_": lambda: tier_slots.index_copy_(0, di, pool.index_select(0, si)),
    }
    for name, fn in variants.items():
        _overlap_one(eng, name, fn, n)
    while eng.has_unfinished_requests():
        eng.step()


def _overlap_one(eng, name: str, store, n: int) -> None:
    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    one = statistics.median(timed(store) for _ in range(5))
    repeat = max(1, round(statistics.median(timed(eng.step) for _ in range(3)) / one))

    def copy() -> None:
        for _ in range(repeat):
            store()

    def both() -> None:
        th = threading.Thread(target=copy)
        th.start()
        eng.step()
        th.join()

    step_s, copy_s, both_s = [], [], []
    for _ in range(8):
        step_s.append(timed(eng.step))
        copy_s.append(timed(copy))
        both_s.append(timed(both))
    s, c, b = (statistics.median(x) for x in (step_s, copy_s, both_s))
    print(
        f"overlap ({name}): decode step {s * 1e3:.2f} ms, store of {n * repeat} blocks "
        f"{c * 1e3:.2f} ms; "
        f"one after the other {(s + c) * 1e3:.2f} ms, overlapped on a thread {b * 1e3:.2f} ms "
        f"(max of the two {max(s, c) * 1e3:.2f} ms)"
    )


def swap_vs_recompute(args) -> None:
    from engine import SamplingParams

    bs, n = args.block_size, args.swap_tokens - 7  # preempted with a partial block of 10 tokens
    pool = -(-(n + 4) // bs) + 1
    off, on, vocab = _engines(args, pool, 2 * pool + 8, max_num_seqs=1)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    res = {}
    for name, llm in (("recompute (tier off)", off), ("swap (tier on)", on)):
        eng = llm.engine
        llm.generate([_prompt(7, 64, vocab)], one, use_tqdm=False)  # warm-up
        victim = eng.add_request("victim", _prompt(1, n, vocab), greedy)
        while victim.num_output_tokens < 2:
            eng.step()
        eng.scheduler.running.remove(victim)
        eng.scheduler._preempt(victim)  # what schedule() does to a victim short of blocks
        filler = eng.add_request("filler", _prompt(2, pool * bs - 1, vocab), one, priority=-1)
        while not filler.status.is_finished:
            eng.step()  # runs first (priority) and pushes the victim's blocks out of the pool
        before, t = victim.num_output_tokens, time.perf_counter()
        while victim.num_output_tokens == before:
            eng.step()
        res[name] = time.perf_counter() - t
        while eng.has_unfinished_requests():
            eng.step()
    s = on.engine.stats()
    rec, swp = res["recompute (tier off)"], res["swap (tier on)"]
    print(
        f"preempted {n}-token request resumed: recompute {rec * 1e3:.1f} ms, swap-in "
        f"{swp * 1e3:.1f} ms ({s.kv_offload_swap_ins} swap-in, {s.kv_offload_promotions} "
        f"blocks promoted)  ratio recompute/swap {rec / swp:.1f}x"
    )


def swap_benchmarks(args) -> None:
    from cpu_info import cpu_isa

    print(
        f"CPU: {cpu_isa()}; model {args.model} layers={args.num_layers or 'all'} "
        f"block_size={args.block_size}"
    )
    swap_vs_recompute(args)
    decode_on_vs_off(args)
