from __future__ import annotations

import collections
import ctypes
import functools
from collections.abc import Callable
from typing import Any

import pytest

from shardserve.model import native_kernels


class CountingLibrary:
    """The real C library, counting the calls made into each kernel (calls go straight on)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self._lib, name)

        def call(*args: Any) -> Any:
            self.calls[name] += 1
            return fn(*args)

        return call


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.stash[_CALL_PASSED] = report.passed
    return report


_CALL_PASSED = pytest.StashKey[bool]()


@pytest.fixture(params=["c_kernels", "pytorch"])
def kernel_path(request, monkeypatch):
    """Run a model test twice: with the C kernels (the default) and on the PyTorch fallback.

    The C variant checks that it really ran C: without that, a build that failed (library() is
    None) would silently run the PyTorch path twice. It skips only where no compiler exists."""
    native_kernels.library.cache_clear()
    if request.param == "pytorch":
        monkeypatch.setenv("SHARDSERVE_NATIVE_KERNELS", "0")
        yield request.param
    else:
        if not native_kernels.compiler_available():
            pytest.skip("no C compiler (SHARDSERVE_CC): the C variant would run PyTorch again")
        monkeypatch.delenv("SHARDSERVE_NATIVE_KERNELS", raising=False)
        lib = native_kernels.library()
        assert lib is not None, "a C compiler is present but the kernels did not build (see log)"
        counting = CountingLibrary(lib)
        with native_kernels.using(counting):  # type: ignore[arg-type]
            yield request.param
        # Only after a passing test: a failure earlier on should not also report this.
        if request.node.stash.get(_CALL_PASSED, False):
            assert counting.calls, "the c_kernels variant never called a C kernel"
    monkeypatch.undo()
    native_kernels.library.cache_clear()


@pytest.fixture
def native_kernels_on(monkeypatch):
    """The C path under test, whatever SHARDSERVE_NATIVE_KERNELS says in the caller's shell."""
    monkeypatch.delenv("SHARDSERVE_NATIVE_KERNELS", raising=False)
    native_kernels.library.cache_clear()
    yield
    monkeypatch.undo()
    native_kernels.library.cache_clear()


@pytest.fixture(scope="session")
def level_library() -> Callable[[str], ctypes.CDLL]:
    """level -> the kernels built at that ISA level (native_kernels.build_level: native, avx2,
    portable), loaded once a session. The .so is cached on disk under SHARDSERVE_CACHE_DIR by
    its flags, so only the first run after a source edit pays a build (~20-40 s a level on 2
    cores), and the other test files' builds with the same flags are the same files."""
    return functools.cache(native_kernels.build_level)
