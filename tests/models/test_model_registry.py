"""The model registry: registration by class and by "module:Class", plugin discovery through
`pdserve.model_plugins` entry points, the unknown-architecture error; and the example
out-of-tree architecture (examples/tiny_arch) served by the engine equals its own plain-torch
reference (paged KV, chunked prefill, prefix cache)."""

import importlib.metadata
import json

import pytest
import torch
from tiny_plugin import EXAMPLE_ROOT, write_entry_point_dist

from engine.models.registry import PLUGIN_GROUP, ModelRegistry, UnknownArchitectureError

TEXTS = [
    "The quick brown fox jumps over the lazy dog, again and again and again.",
    "Paged attention stores keys and values in fixed-size blocks of the pool.",
]


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    """Each test sees the built-in table only, plugins not yet loaded; restored after."""
    # the built-in table only: another test in this process may have loaded the example plugin
    monkeypatch.setattr(ModelRegistry, "_models", dict(ModelRegistry.BUILTIN))
    monkeypatch.setattr(ModelRegistry, "_failed_plugins", {})
    monkeypatch.setattr(ModelRegistry, "_plugins_loaded", False)
    monkeypatch.syspath_prepend(str(EXAMPLE_ROOT))


def _no_plugins(monkeypatch, *eps):
    monkeypatch.setattr(
        importlib.metadata, "entry_points", lambda group=None: [e for e in eps if e.group == group]
    )


def test_builtin_llama_resolves_lazily(monkeypatch):
    _no_plugins(monkeypatch)
    from engine.models.llama import Transformer
    from engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

    assert ModelRegistry.resolve("LlamaForCausalLM") is Transformer
    assert ModelRegistry.resolve("Qwen2ForCausalLM") is Qwen2ForCausalLM
    assert ModelRegistry.resolve("Qwen3ForCausalLM") is Qwen3ForCausalLM
    assert ModelRegistry.get_supported_archs() == [
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "GraniteForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Olmo2ForCausalLM",
        "Phi3ForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    ]


def test_register_by_class_and_by_string(monkeypatch):
    _no_plugins(monkeypatch)

    class Mine(torch.nn.Module):
        pass

    ModelRegistry.register_model("MineForCausalLM", Mine)
    ModelRegistry.register_model("TinyForCausalLM", "tiny_arch.model:TinyForCausalLM")
    assert ModelRegistry.resolve("MineForCausalLM") is Mine
    from tiny_arch.model import TinyForCausalLM

    assert ModelRegistry.resolve("TinyForCausalLM") is TinyForCausalLM
    assert {"MineForCausalLM", "TinyForCausalLM"} <= set(ModelRegistry.get_supported_archs())
    with pytest.raises(ValueError, match="module:Class"):
        ModelRegistry.register_model("Bad", "no_colon_here")
    ModelRegistry.register_model("GoneForCausalLM", "no_such_module_xyz:Model")
    with pytest.raises(UnknownArchitectureError, match="cannot import"):
        ModelRegistry.resolve("GoneForCausalLM")


def test_unknown_architecture_lists_supported(monkeypatch, tmp_path):
    _no_plugins(monkeypatch)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NopeForCausalLM"]}))
    from engine.models.loader import load_model

    with pytest.raises(
        UnknownArchitectureError,
        match=r"'NopeForCausalLM' is not supported; supported: Gemma2ForCausalLM, "
        r"Gemma3ForCausalLM, GraniteForCausalLM, LlamaForCausalLM, "
        r"MistralForCausalLM, MixtralForCausalLM, Olmo2ForCausalLM, "
        r"Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
        r"Qwen3MoeForCausalLM",
    ):
        load_model(tmp_path)


def test_plugins_are_discovered_through_entry_points(monkeypatch):
    good = importlib.metadata.EntryPoint("tiny_arch", "tiny_arch:register", PLUGIN_GROUP)
    broken = importlib.metadata.EntryPoint("broken", "no_such_module_xyz:register", PLUGIN_GROUP)
    other = importlib.metadata.EntryPoint("x", "no_such_module_xyz:f", "some.other.group")
    _no_plugins(monkeypatch, good, broken, other)
    assert "TinyForCausalLM" in ModelRegistry.get_supported_archs()
    with pytest.raises(UnknownArchitectureError, match="plugin 'broken' failed to load"):
        ModelRegistry.resolve("NopeForCausalLM")


def test_entry_points_of_an_installed_distribution(tmp_path, monkeypatch):
    """The real importlib.metadata scan finds a dist-info on sys.path (as in the workers)."""
    monkeypatch.syspath_prepend(str(write_entry_point_dist(tmp_path)))
    assert ModelRegistry.is_supported("TinyForCausalLM")


def test_llama_loads_through_the_contract_and_keeps_rope_in_fp32(model_dir):
    """load_model (from_config, load_weights over the streamed files, .to) equals the module
    fed the whole state dict at once; a bf16 load keeps the RoPE table fp32 (the loader does
    not know the model: the model keeps it so)."""
    from safetensors.torch import load_file

    from engine.models.llama import Transformer
    from engine.models.loader import load_model
    from engine.models.rope import rope_cache

    loaded = load_model(model_dir, num_layers=1).model
    config = json.loads((model_dir / "config.json").read_text())
    whole = Transformer.from_config({**config, "num_hidden_layers": 1})
    whole.load_weights(load_file(str(model_dir / "model.safetensors")).items())
    a, b = loaded.state_dict(), whole.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    bf16 = load_model(model_dir, dtype=torch.bfloat16, num_layers=1).model
    assert bf16.embed_tokens.weight.dtype == torch.bfloat16
    (table,) = bf16.rope_tables
    assert table.dtype == torch.float32 and torch.equal(table, rope_cache(bf16.args.rope_spec(0)))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, model_dir):
    import sys

    sys.path.insert(0, str(EXAMPLE_ROOT))
    try:
        from tiny_arch.make_checkpoint import make_checkpoint
    finally:
        sys.path.remove(str(EXAMPLE_ROOT))
    return make_checkpoint(
        tmp_path_factory.mktemp("tiny") / "tiny-ckpt", layers=2, seed=0, tokenizer_dir=model_dir
    )


def test_example_architecture_serves_like_its_reference(monkeypatch, tiny_checkpoint):
    from tiny_arch import register
    from tiny_arch.model import TinyForCausalLM
    from tiny_arch.reference import reference_greedy

    from engine import LLM, SamplingParams

    _no_plugins(monkeypatch)
    register()
    # small chunks and blocks: prompts span several chunks and blocks, and the second pass
    # reads the first pass's blocks from the prefix cache
    llm = LLM(
        str(tiny_checkpoint),
        dtype="float32",
        kv_cache_memory=8 << 20,
        block_size=8,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=8,
    )
    model = llm.engine.loaded.model
    assert isinstance(model, TinyForCausalLM) and llm.engine.loaded.args.n_layers == 2
    prompts = [llm.tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = [reference_greedy(model, p, 10) for p in prompts]
    assert expected[0] != expected[1]
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert min(o.num_cached_tokens for o in outs) >= 8  # the second pass hit the prefix cache
