"""Suite-wide set-up. Environment variables here must be set before any test module imports
the packages that read them (Triton reads TRITON_INTERPRET at import; UCX reads its variables
when the first NIXL agent is created)."""

import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on CPU-only machines.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# NIXL/UCX between processes on one host: loopback only.
os.environ.setdefault("UCX_NET_DEVICES", "lo")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def model_dir():
    """The prepared default model (prepared once per machine; cached on disk)."""
    from engine.models.prepare import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer():
    """transformers' own GGUF->tokenizer conversion: an independent reference for ours."""
    from transformers import AutoTokenizer

    from engine.models.prepare import bundled_gguf_path

    gguf = bundled_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _track_block_managers():
    """Every BlockManager created in this test session, held weakly."""
    import weakref

    from engine.kv.block_manager import BlockManager

    live = weakref.WeakSet()
    original = BlockManager.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        live.add(self)

    BlockManager.__init__ = tracking_init
    return live


_LIVE_BLOCK_MANAGERS = _track_block_managers()


@pytest.fixture(autouse=True)
def no_leaked_kv_blocks():
    """After every test, every live block manager (from this test or a longer-lived fixture)
    has all its blocks free — cached blocks with ref count 0 count as free — and no block
    tables: nothing leaked."""
    yield
    for bm in list(_LIVE_BLOCK_MANAGERS):
        leaked = bm.pool.num_blocks - bm.pool.num_free_blocks
        assert leaked == 0, f"{leaked} KV blocks still referenced after the test"
        assert not bm._tables, f"block tables left behind: {list(bm._tables)[:5]}"
