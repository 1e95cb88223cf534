"""What tensor_parallel_size > 1 refuses at start, and a rank's death failing the worker."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from engine.checks import FieldError
from engine.config import EngineConfig

TP2 = dict(tensor_parallel_size=2)


@pytest.mark.parametrize(
    "extra,field",
    [
        (dict(enable_lora=True), "enable_lora"),
        (dict(kv_offloading_size=1 << 20), "kv_offloading_size"),
        (dict(enable_sleep_mode=True), "enable_sleep_mode"),
        (dict(worker_extension_cls="m:C"), "worker_extension_cls"),
        (
            dict(
                speculative_config={
                    "method": "draft_model",
                    "model": "self:1",
                    "num_speculative_tokens": 2,
                }
            ),
            "speculative_config",
        ),
        (dict(device="cuda"), "kv_cache_memory"),
    ],
)
def test_unsupported_features_are_refused_by_name(extra, field):
    with pytest.raises(FieldError, match=f"{field} .*tensor_parallel_size > 1") as info:
        EngineConfig(**TP2, **extra)
    assert info.value.field == field
    EngineConfig(**extra)  # fine on one rank


def test_ngram_speculation_is_allowed():
    EngineConfig(
        **TP2,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
    )


def test_tp_flag_spellings():
    import argparse

    from engine.config import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv in (["-tp", "2"], ["--tensor-parallel-size", "2"]):
        config = EngineConfig.from_args(parser.parse_args(argv + ["--distributed-timeout", "7"]))
        assert (config.tensor_parallel_size, config.distributed_timeout_s) == (2, 7.0)


DRIVER = textwrap.dedent("""
    import sys
    from engine import LLM, SamplingParams
    llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_timeout_s=5.0, dtype="float32",
              kv_cache_memory=8 << 20)
    print("ranks", *llm.engine.parallel_group.pids, flush=True)
    while True:
        llm.generate(
            ["Hi there, tell me a long story"], SamplingParams(max_tokens=32), use_tqdm=False
        )
""")


def test_killed_rank_fails_rank_0_within_the_timeout(tiny_model, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    rank0 = subprocess.Popen(
        [sys.executable, str(script), str(tiny_model("llama-kv1"))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = rank0.stdout.readline()
        assert line.startswith("ranks"), rank0.stderr.read()
        rank1 = int(line.split()[1])
        time.sleep(0.5)  # generating
        os.kill(rank1, signal.SIGKILL)
        start = time.monotonic()
        code = rank0.wait(timeout=15)
        assert code != 0
        assert time.monotonic() - start < 5.0 + 5.0
        assert "rank" in rank0.stderr.read()
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait()


def test_rank_dying_while_idle_fails_the_next_step(tiny_model):
    """Noticed by the group's monitor (on_failure: a worker exits 1 there); an offline
    engine's next step raises, naming the rank."""
    from engine import LLM, SamplingParams
    from engine.parallel.group import RankFailedError

    reasons = []
    llm = LLM(
        str(tiny_model("llama-kv1")),
        tensor_parallel_size=2,
        distributed_timeout_s=5.0,
        dtype="float32",
        kv_cache_memory=8 << 20,
    )
    group = llm.engine.parallel_group
    group.on_failure = reasons.append
    try:
        os.kill(group.pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 3
        while not reasons and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reasons and "rank 1" in reasons[0]
        llm.engine.add_request("r", "Hi", SamplingParams(max_tokens=2))
        with pytest.raises(RankFailedError, match="rank 1"):
            llm.engine.step()
        llm.engine.abort_request("r")
    finally:
        llm.close()
