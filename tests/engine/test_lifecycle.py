"""Weights lifecycle offline (vLLM's names): sleep(1) / wake_up frees the KV pool and gives
identical output; sleep(2) drops the weights and wakes from an update or the checkpoint;
update_weights changes outputs exactly as a fresh engine loaded with those weights, and no
block cached before the update is ever hit after it; collective_rpc reaches the extension."""

import pytest
import torch

from engine import LLM, SamplingParams

NUM_LAYERS = 2
PROMPTS = ["The capital of France is", "def add(a, b):"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _llm(model_dir, **kw):
    kw.setdefault("kv_cache_memory", 256 << 20)
    return LLM(str(model_dir), num_layers=NUM_LAYERS, dtype="float32", enable_sleep_mode=True, **kw)


def _greedy(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


_SLEEP_RSS = """
import sys
from engine import LLM
llm = LLM(
    sys.argv[1], num_layers=2, dtype="float32", enable_sleep_mode=True, kv_cache_memory=256 << 20
)
llm.engine.kv_cache.fill_(0)  # every page resident
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
before = rss()
llm.sleep(1)
print(before - rss())
"""


def test_sleep_level_1_frees_the_pool_and_wakes_to_the_same_output(model_dir):
    import subprocess
    import sys

    # RSS in a fresh process: this one's allocator history (other tests) would blur it.
    freed = int(
        subprocess.run(
            [sys.executable, "-c", _SLEEP_RSS, str(model_dir)],
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        ).stdout.split()[-1]
    )
    assert freed > 200 << 20  # the 256 MiB pool went back to the OS
    llm = _llm(model_dir)
    before = _greedy(llm)
    llm.sleep(1)
    assert llm.is_sleeping() and llm.engine.kv_cache.numel() == 0
    llm.wake_up()
    assert not llm.is_sleeping()
    assert _greedy(llm) == before


def test_sleep_level_2_drops_weights_and_wakes_from_the_checkpoint(model_dir):
    llm = _llm(model_dir, kv_cache_memory=16 << 20)
    before = _greedy(llm)
    llm.sleep(2)
    assert all(p.numel() == 0 for p in llm.engine.loaded.model.parameters())
    llm.wake_up()
    assert _greedy(llm) == before


def test_update_weights_equals_a_fresh_engine_with_those_weights(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    llm = _llm(model_dir, kv_cache_memory=16 << 20)
    long = [" ".join(["cache me if you can"] * 12)]  # full blocks for the prefix cache
    before = _greedy(llm, long)
    state = load_file(str(model_dir / "model.safetensors"))
    torch.manual_seed(0)
    changed = {
        n: t + 0.1 * torch.randn_like(t)
        for n, t in state.items()
        if n.startswith("model.layers.1.") and n.endswith("proj.weight")
    }
    hits = llm.engine.stats().prefix_cache_hits
    assert llm.update_weights(changed.items()) == len(changed)
    assert llm.engine.weights_version == 1
    after = _greedy(llm, long)
    assert after != before
    assert llm.engine.stats().prefix_cache_hits == hits  # nothing cached before was reused
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    save_file({**state, **changed}, str(tmp_path / "model.safetensors"))
    fresh = LLM(str(tmp_path), num_layers=NUM_LAYERS, dtype="float32", kv_cache_memory=16 << 20)
    assert _greedy(fresh, long) == after
    # from a path too, and while asleep at level 2 (the update is what wakes)
    llm.sleep(2)
    llm.update_weights(tmp_path / "model.safetensors")
    llm.wake_up()
    assert _greedy(llm, long) == after


def test_bad_updates_change_nothing(model_dir):
    llm = _llm(model_dir, kv_cache_memory=16 << 20)
    before = _greedy(llm)
    good = ("model.layers.0.mlp.down_proj.weight", torch.zeros(576, 1536))
    with pytest.raises(ValueError, match="not a weight of this model"):
        llm.update_weights([good, ("model.layers.0.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"has shape \(3, 3\)"):
        llm.update_weights([good, ("model.norm.weight", torch.zeros(3, 3))])
    assert _greedy(llm) == before and llm.engine.weights_version == 0


class Extension:
    """A worker extension (vLLM's worker_extension_cls) for the test below."""

    def __init__(self, engine):
        self.engine = engine

    def num_blocks(self):
        return self.engine.block_manager.pool.num_blocks


def test_collective_rpc_calls_the_extension_then_the_engine(model_dir):
    llm = _llm(model_dir, kv_cache_memory=16 << 20, worker_extension_cls=f"{__name__}:Extension")
    assert llm.collective_rpc("num_blocks") == [llm.engine.block_manager.pool.num_blocks]
    assert llm.collective_rpc("is_sleeping") == [False]
    with pytest.raises(ValueError, match="no method"):
        llm.collective_rpc("no_such_method")


def test_sleep_needs_sleep_mode_and_an_idle_engine(model_dir):
    plain = LLM(str(model_dir), num_layers=NUM_LAYERS, dtype="float32", kv_cache_memory=16 << 20)
    with pytest.raises(RuntimeError, match="enable_sleep_mode"):
        plain.sleep(1)
    llm = _llm(model_dir, kv_cache_memory=16 << 20)
    llm.engine.add_request("r", "hello", PARAMS)
    with pytest.raises(RuntimeError, match="still running"):
        llm.sleep(1)
    llm.engine.abort_request("r")
