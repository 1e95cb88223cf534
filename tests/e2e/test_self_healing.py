"""`pdserve up` when a worker cannot start: a prefill worker given a flag it rejects (through
--prefill-arg, the per-role flag, so only that role fails) is retried with backoff until the
crash-loop limit, `up` serves anyway (decode workers prefill locally), `pdserve status` and the
up log report the crash loop, and shutdown leaves no process behind."""

import asyncio
import time

import openai
import pytest
from up_cluster import Up, alive, chat

pytestmark = pytest.mark.slow


def test_a_worker_failing_at_start_is_retried_and_not_fatal(tmp_path):
    up = Up(
        tmp_path,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--prefill-arg=--no-such-flag",
        "--restart-backoff",
        "0.2",
        "--max-restarts",
        "2",
    )
    pids = set()
    try:
        pids |= {p for ps in up.children().values() for p in ps}
        slot = up.wait_slot("prefill-1", "crash-loop", restarts=2)
        assert slot["pid"] is None and slot["last_exit"] == 2  # argparse's exit code
        assert up.slots()["decode-2"]["state"] == "ready"

        async def one():
            client = openai.AsyncOpenAI(base_url=up.url + "/v1", api_key="none", max_retries=0)
            return await chat(client, 1)

        assert asyncio.run(one())
        status = up.cli("status")
        assert any(
            line.split()[:2] == ["prefill-1", "prefill"]
            and line.split()[2:6] == ["-", "crash-loop", "2", "2"]
            for line in status.splitlines()
        ), status
        assert any(
            line.startswith("[") and "error: prefill-1 (prefill) crashed 3 times" in line
            for line in up.output
        ), "".join(up.output)
        pids |= {p for ps in up.children().values() for p in ps}
    finally:
        code = up.stop()
    assert code == 0, "".join(up.output[-30:])
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)], "pdserve up left processes behind"
