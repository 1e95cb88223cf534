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


def pytest_collection_modifyitems(config, items):
    import pytest

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
