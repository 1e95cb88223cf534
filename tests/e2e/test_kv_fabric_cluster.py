"""The KV fabric through a whole `pdserve up` cluster: 1 prefill + 2 decode workers, a small
second tier on each, round-robin placement so that a conversation's consecutive turns land on
different decode workers. Multi-turn chats must give exactly a single engine's answers while
turns >= 2 find their history cached somewhere — pulled from the worker that holds it instead
of recomputed — and afterwards nothing is held anywhere: no block in use on any worker, each
worker's tier holding exactly the blocks it announces, the router's index equal to the
workers' pools and tiers."""

import asyncio
import random

import httpx
import pytest
from pd_cluster import metric
from up_cluster import Up

from cluster.grpc_auth import aio_channel
from engine import LLM, SamplingParams
from local_cluster.run_file import cluster_auth
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 24


def _words(rng: random.Random, n: int) -> str:
    vocab = [
        "river",
        "stone",
        "lamp",
        "orange",
        "quiet",
        "north",
        "paper",
        "seven",
        "window",
        "garden",
        "copper",
        "signal",
        "winter",
        "harbor",
        "velvet",
        "engine",
        "meadow",
    ]
    return " ".join(rng.choice(vocab) for _ in range(n))


def test_multi_turn_chats_reuse_kv_across_workers(tmp_path, model_dir):
    up = Up(
        tmp_path,
        "--prefill",
        "1",
        "--decode",
        "2",
        "--kv-offloading-size",
        "8MiB",
        "--router-arg=--policy=round_robin",
        "--router-arg=--enable-prompt-tokens-details",
    )
    try:
        reference = LLM(str(model_dir), num_layers=2, kv_cache_memory=32 << 20, dtype="float32")
        http = httpx.Client(base_url=up.url, timeout=120)
        rng = random.Random(7)
        conversations = [[] for _ in range(3)]
        previous = [[] for _ in conversations]  # each conversation's last prompt + answer ids
        cacheable = cached_tokens = 0
        for turn in range(3):
            for c, messages in enumerate(conversations):
                messages.append({"role": "user", "content": _words(rng, 40)})
                reply = (
                    http.post(
                        "/v1/chat/completions",
                        json={
                            "model": MODEL,
                            "messages": messages,
                            "max_tokens": MAX_TOKENS,
                            "temperature": 0,
                        },
                    )
                    .raise_for_status()
                    .json()
                )
                text = reply["choices"][0]["message"]["content"]
                ids = (
                    http.post("/tokenize", json={"model": MODEL, "messages": messages})
                    .raise_for_status()
                    .json()["tokens"]
                )
                [ref] = reference.generate(
                    [ids], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
                )
                assert text == ref.outputs[0].text, (turn, messages)
                usage = reply["usage"]
                if turn:
                    # Held by some worker: the previous prompt's and answer's full blocks (the
                    # answer's last token is never computed) as far as this prompt repeats
                    # them token for token (an answer's text may tokenize differently).
                    held = previous[c][:-1]
                    same = next(
                        (i for i, (a, b) in enumerate(zip(held, ids)) if a != b),
                        min(len(held), len(ids) - 1),
                    )
                    cacheable += same // 16 * 16
                    cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
                previous[c] = ids + ref.outputs[0].token_ids
                messages.append({"role": "assistant", "content": text})
        workers = up.workers()
        assert (
            metric(
                up.url.removeprefix("http://"),
                "pdserve_router_kv_pull_decisions_total",
                outcome="pull",
            )
            >= 1
        )
        pulled = sum(
            metric(w.metrics_address, "pdserve_worker_kv_pulls_total", outcome="pulled")
            for w in workers
        )
        assert pulled >= 1
        # Round robin sends every later turn to a worker that did not serve the one before,
        # yet nearly all of the history is found (pulled, or held by the worker placed on).
        assert cached_tokens >= 0.9 * cacheable, (cached_tokens, cacheable)
        asyncio.run(_nothing_held(up, workers))
    finally:
        assert up.stop() == 0


async def _nothing_held(up: Up, workers, timeout_s: float = 15.0) -> None:
    """Every block free on every worker; each tier holds exactly the blocks its worker
    announces as tier blocks; the router's index holds exactly the union of what the workers
    announce (pools and tiers)."""
    auth = cluster_auth(up.run)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        problems, announced = [], set()
        for w in workers:
            async with aio_channel(w.grpc_address, auth) as channel:
                stub = pb_grpc.WorkerStub(channel)
                c = (await stub.Health(pb.HealthRequest(), timeout=5)).capacity
                cached = await stub.GetCachedBlocks(pb.CachedBlocksRequest(), timeout=5)
            tiers = list(cached.tiers) or [0] * len(cached.block_hashes)
            announced |= set(cached.block_hashes)
            if c.free_blocks != c.total_blocks or c.running or c.waiting:
                problems.append(f"{w.worker_id}: {c.total_blocks - c.free_blocks} blocks in use")
            if c.kv_offload_used_blocks != sum(tiers):
                problems.append(
                    f"{w.worker_id}: tier holds {c.kv_offload_used_blocks}, announces {sum(tiers)}"
                )
        indexed = metric(up.url.removeprefix("http://"), "pdserve_router_kv_index_blocks")
        if indexed != len(announced):
            problems.append(f"router indexes {indexed} blocks, workers hold {len(announced)}")
        if not problems:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("; ".join(problems))
        await asyncio.sleep(0.2)
