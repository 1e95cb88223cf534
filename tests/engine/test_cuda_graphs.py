"""CUDA graphs for decode steps (engine/runner/cuda_graphs.py), on the CPU: the graph's static
buffers, padding and row selection give the eager engine's greedy tokens when "replaying"
re-runs the recorded forward over those buffers (`rerun_capture`, a fake of the CUDA capture
used only here); a failed capture turns graphs off and loses nothing; sleep and weight
updates drop the graphs; the capture sizes and the flag. The real capture runs in the GPU
check (tests/engine/test_gpu_engine.py)."""

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.parallel.step import GroupArrays, StepInputs
from engine.runner.cuda_graphs import DecodeGraphs, default_capture_sizes

PROMPTS = [
    "The capital of France is",
    "def square(x):",
    "Hello, my name is",
    "One, two, three,",
    "Paris is",
    "The sky",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def rerun_capture(forward, pool):
    """Fake of `cuda_capture`: replay runs the forward again into the captured output."""
    out = forward()
    return (lambda: out.copy_(forward())), out, pool


def failing_capture(forward, pool):
    raise RuntimeError("operation not permitted when stream is capturing")


def _llm(model_dir, **kw):
    return LLM(
        str(model_dir),
        num_layers=2,
        kv_cache_memory=8 << 20,
        block_size=16,
        dtype="float32",
        attention_backend="triton",
        max_model_len=256,
        enable_sleep_mode=True,
        **kw,
    )


def _with_graphs(llm, sizes, capture=rerun_capture) -> DecodeGraphs:
    engine = llm.engine
    graphs = DecodeGraphs(
        engine.loaded.model,
        engine.backend,
        engine.kv_cache,
        engine.block_manager.num_groups,
        engine.max_model_len,
        sizes,
        capture,
    )
    engine.runner.graphs = graphs
    engine.lifecycle.moved = graphs.drop
    return graphs


def _greedy(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def eager_tokens(model_dir):
    return _greedy(_llm(model_dir))


def test_replayed_decode_steps_give_the_eager_tokens(model_dir, eager_tokens):
    llm = _llm(model_dir, max_num_seqs=8)
    # Six decode rows pad to 8; three of them (a later batch) to 4; none fits 2.
    graphs = _with_graphs(llm, (2, 4, 8))
    assert _greedy(llm) == eager_tokens
    assert graphs.captured == [8]
    assert _greedy(llm, PROMPTS[:3]) == eager_tokens[:3]
    assert graphs.captured == [4, 8]
    assert llm.engine.block_manager.pool.num_free_blocks == llm.engine.block_manager.pool.num_blocks


def _decode_step(rows: int, block: int) -> StepInputs:
    """`rows` decode rows at position 3 of their own block (block, block + 1, ...)."""
    tables = [[block + r] for r in range(rows)]
    slots = [np.array([t[0] * 16 + 3 for t in tables])]
    return StepInputs(
        np.arange(rows, dtype=np.int64),
        np.full(rows, 3, dtype=np.int64),
        [GroupArrays.build(slots, tables)],
        [1] * rows,
        [4] * rows,
        np.arange(rows),
    )


def test_padding_rows_store_nothing_after_a_larger_step(model_dir):
    llm = _llm(model_dir)
    graphs = _with_graphs(llm, (8,))
    with torch.inference_mode():
        assert graphs.logits(_decode_step(6, 1)).shape == (6, 49152)
        assert graphs.logits(_decode_step(3, 1)).shape == (3, 49152)
    assert graphs.slots[0][3:].tolist() == [-1] * 5  # rows 3-5 held the 6-row step's slots
    assert graphs.seq_lens[3:].tolist() == [1] * 5
    assert graphs.slots[0][:3].tolist() == [16 * b + 3 for b in (1, 2, 3)]


def test_batches_above_the_largest_size_run_eagerly(model_dir, eager_tokens):
    llm = _llm(model_dir)
    graphs = _with_graphs(llm, (1, 2))
    assert _greedy(llm) == eager_tokens
    assert graphs.captured == []  # six rows: never a graph
    assert _greedy(llm, PROMPTS[:1]) == eager_tokens[:1]
    assert graphs.captured == [1]


def test_a_failed_capture_turns_graphs_off_and_loses_nothing(model_dir, eager_tokens):
    llm = _llm(model_dir)
    graphs = _with_graphs(llm, (8,), failing_capture)
    assert _greedy(llm) == eager_tokens
    assert graphs.disabled == "RuntimeError: operation not permitted when stream is capturing"
    assert graphs.captured == []


def test_sleep_and_weight_updates_drop_the_graphs(model_dir, eager_tokens):
    llm = _llm(model_dir)
    graphs = _with_graphs(llm, (8,))
    assert _greedy(llm) == eager_tokens and graphs.captured == [8]
    llm.sleep(1)
    assert graphs.captured == []
    llm.wake_up()
    assert _greedy(llm) == eager_tokens and graphs.captured == [8]
    weight = llm.engine.loaded.model.embed_tokens.weight
    llm.engine.lifecycle.update_weights([("model.embed_tokens.weight", weight.clone())])
    assert graphs.captured == []


def test_capture_all_records_every_size_largest_first(model_dir):
    llm = _llm(model_dir)
    order = []

    def recording(forward, pool):
        replay, out, pool = rerun_capture(forward, pool)
        order.append(out.shape[0])
        return replay, out, pool

    graphs = _with_graphs(llm, (4, 1, 2), recording)
    pool = llm.engine.kv_cache.clone()
    with torch.inference_mode():
        graphs.capture_all()
    assert order == [4, 2, 1] and graphs.captured == [1, 2, 4]
    assert torch.equal(llm.engine.kv_cache, pool)  # capturing stored nothing: every slot was -1


def test_default_capture_sizes_follow_vllm():
    assert default_capture_sizes(128) == (1, 2, 4, *range(8, 129, 8))
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert default_capture_sizes(1) == (1,)


def test_cuda_graph_sizes_flag_is_checked_and_refused_where_no_graph_is_captured():
    assert EngineConfig(model="m", cuda_graph_sizes=[4, 1]).cuda_graph_sizes == (4, 1)
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(model="m", cuda_graph_sizes=(0,))
    with pytest.raises(
        ValueError, match="cuda_graph_sizes needs CUDA graphs, which enforce_eager turns off"
    ):
        EngineConfig(model="m", cuda_graph_sizes=(8,), enforce_eager=True)
    with pytest.raises(
        ValueError, match="cuda_graph_sizes is not supported with tensor_parallel_size > 1"
    ):
        EngineConfig(
            model="m", cuda_graph_sizes=(8,), tensor_parallel_size=2, kv_cache_memory=1 << 20
        )


def test_graphs_are_off_on_the_cpu_and_sizes_for_them_refused(model_dir):
    assert _llm(model_dir).engine.runner.graphs is None
    with pytest.raises(ValueError, match="cuda_graph_sizes: decode steps on the CPU run eagerly"):
        _llm(model_dir, cuda_graph_sizes=[8])
