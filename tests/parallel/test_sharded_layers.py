"""The sharded model in one process: N fake ranks (threads over engine/parallel/fake.py) each
run their shard of a tiny checkpoint; their logits equal the whole model's. Covers every
architecture's slicing (tp_slices.py) and the layers' collectives without process groups."""

import pytest
import torch

from engine.attention import TorchAttentionBackend
from engine.models.loader import load_model
from engine.models.tp_slices import shard_args
from engine.parallel.fake import FakeGroup
from engine.parallel.shard import TPShard, even_span, head_split
from tests.models.test_arch_parity import one_sequence

IDS = [1, 5, 9, 200, 4000, 49000, 17, 3, 8, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


def sharded_logits(path, size, expert_parallel=False):
    def rank(r, comm):
        loaded = load_model(path, torch.float32, "cpu", shard=TPShard(r, size, expert_parallel))
        loaded.model.use_communicator(comm)
        n = len(IDS)
        return loaded.model(
            torch.tensor(IDS),
            torch.arange(n),
            one_sequence(loaded.args, n, TorchAttentionBackend()),
        )

    return FakeGroup(size).run(rank)


@torch.inference_mode()
def whole_logits(path):
    loaded = load_model(path, torch.float32, "cpu")
    return loaded.model(
        torch.tensor(IDS),
        torch.arange(len(IDS)),
        one_sequence(loaded.args, len(IDS), TorchAttentionBackend()),
    )


@pytest.mark.parametrize(
    "arch,size,ep",
    [
        ("llama-attention-bias", 2, False),
        ("qwen2", 2, False),
        ("qwen3", 2, False),
        ("mistral", 2, False),
        ("gemma2", 2, False),
        ("gemma3", 4, False),
        ("phi3", 2, False),
        ("granite", 2, False),
        ("olmo2", 4, False),
        ("mixtral", 2, False),
        ("mixtral", 2, True),
        ("qwen3-moe", 2, False),
        ("qwen3-moe", 4, True),
        ("llama-kv1", 2, False),
        ("llama-9q3kv", 2, False),
    ],
)
def test_sharded_logits_equal_whole(tiny_model, arch, size, ep):
    path = tiny_model(arch)
    want = whole_logits(path)
    for got in sharded_logits(path, size, ep):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_head_split_even_uneven_and_replicated():
    assert [head_split(8, 4, 2, r) for r in range(2)] == [((0, 4), (0, 2)), ((4, 4), (2, 2))]
    assert [head_split(9, 3, 2, r) for r in range(2)] == [((0, 6), (0, 2)), ((6, 3), (2, 1))]
    # 2 KV heads on 4 ranks: each replicated twice, its 2 query heads split one per rank.
    assert [head_split(4, 2, 4, r) for r in range(4)] == [
        ((0, 1), (0, 1)),
        ((1, 1), (0, 1)),
        ((2, 1), (1, 1)),
        ((3, 1), (1, 1)),
    ]
    assert even_span(1536, 2, 1) == (768, 768)
    with pytest.raises(ValueError, match="multiple"):
        head_split(9, 3, 2 * 2, 0)
    with pytest.raises(ValueError, match="query heads"):
        head_split(2, 1, 4, 0)


def test_shard_args_and_vocab_rows(tiny_model):
    import json

    from engine.models.registry import ModelRegistry

    config = json.loads((tiny_model("llama-9q3kv") / "config.json").read_text())
    full = ModelRegistry.resolve("LlamaForCausalLM").model_args(config)
    ranks = [shard_args(full, TPShard(r, 2)) for r in range(2)]
    assert [(a.n_heads, a.n_kv_heads, a.intermediate_size) for a in ranks] == [
        (6, 2, 48),
        (3, 1, 48),
    ]
    assert ranks[1].tp.vocab_rows * 2 >= full.vocab_size and ranks[1].vocab_size == full.vocab_size
