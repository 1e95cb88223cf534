"""A tensor-parallel decode worker in a `pdserve up` cluster (docs/parallelism.md): it serves
through the router (prefilling locally: --prefill 0; tests/e2e/test_tp_disagg.py moves KV
between tensor-parallel workers), its ranks
are its children, and killing one fails the worker, which the supervisor restarts."""

import asyncio
import os
import signal
import time

import openai
from pd_cluster import rank_children
from up_cluster import Up, alive, chat


def chats(url: str, n: int) -> list[str]:
    async def run():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        return await asyncio.wait_for(asyncio.gather(*[chat(client, i) for i in range(n)]), 120)

    return asyncio.run(run())


def test_tp2_decode_worker_serves_and_a_killed_rank_restarts_it(tmp_path):
    up = Up(
        tmp_path,
        "--prefill",
        "0",
        "--decode",
        "1",
        "-tp",
        "2",
        "--worker-arg=--distributed-timeout=10",
    )
    try:
        assert all(chats(up.url, 3))
        worker = up.children()["decode"][0]
        ranks = rank_children(worker)
        assert len(ranks) == 1
        name = next(n for n, s in up.slots().items() if s["pid"] == worker)
        os.kill(ranks[0], signal.SIGKILL)
        slot = up.wait_slot(name, "ready", restarts=1)
        assert slot["last_exit"] == 1 and slot["pid"] != worker
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker)
        assert len(rank_children(slot["pid"])) == 1
        assert all(chats(up.url, 2))
    finally:
        up.stop()
