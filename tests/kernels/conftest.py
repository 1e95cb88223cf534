"""Kernel tests run on CUDA where there is one, else on CPU under the Triton interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 there before anything imports triton)."""

import pytest
import torch


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
