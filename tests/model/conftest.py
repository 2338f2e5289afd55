from __future__ import annotations

import pytest

from shardserve.model import native_kernels


@pytest.fixture(params=["c_kernels", "pytorch"])
def kernel_path(request, monkeypatch):
    """Run a model test twice: with the C kernels (the default) and on the PyTorch fallback."""
    if request.param == "pytorch":
        monkeypatch.setenv("SHARDSERVE_NATIVE_KERNELS", "0")
    native_kernels.library.cache_clear()
    yield request.param
    monkeypatch.undo()
    native_kernels.library.cache_clear()
