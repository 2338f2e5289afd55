"""The cached kernel library's name covers the shared header (csrc/kernels_common.h): an edit to
it must rebuild, as an edit to a .c file does, or a stale library would run old helpers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardserve.model import kernel_build as kb
from shardserve.model import native_kernels as nk

pytestmark = pytest.mark.skipif(
    not nk.compiler_available(), reason="no C compiler (SHARDSERVE_CC): PyTorch path only"
)

SOURCES = (kb.SOURCE, *kb.LINKED_SOURCES)


def _key() -> str:
    return kb.cache_key(shutil.which("gcc") or "gcc", nk.PORTABLE_ARCH, SOURCES)


@pytest.mark.parametrize("header", ["HEADER", "QUANT_HEADER", "ROWS_HEADER"])
def test_a_header_edit_changes_the_cache_key(header: str, monkeypatch, tmp_path: Path) -> None:
    before = _key()
    original: Path = getattr(kb, header)
    edited = tmp_path / original.name
    edited.write_bytes(original.read_bytes() + b"\n/* edited */\n")
    monkeypatch.setattr(kb, header, edited)
    assert _key() != before


def test_the_header_is_included_by_every_source() -> None:
    """Each file takes the shared helpers from the header, none keeps its own copy."""
    for path in SOURCES:
        text = path.read_text()
        # Directly, or through the quantized sources' own header (which includes it), or the
        # row kernels' tables (which include that).
        via = [h for h in (kb.ROWS_HEADER, kb.QUANT_HEADER, kb.HEADER) if h.name in text][0]
        assert f'#include "{via.name}"' in text, path.name
        assert f'#include "{kb.HEADER.name}"' in kb.QUANT_HEADER.read_text()
        assert f'#include "{kb.QUANT_HEADER.name}"' in kb.ROWS_HEADER.read_text()
        assert "static inline float bf16_to_f32" not in text, path.name


_BUILD_AND_REPORT = """
import resource, sys
from pathlib import Path
from shardserve.model import native_kernels as nk
path = nk.kernel_build.build(nk.PORTABLE_ARCH, nk.SOURCE, Path(sys.argv[1]))
print(path, resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime)
"""


def test_processes_starting_together_build_a_library_once(tmp_path: Path) -> None:
    """Two processes asking for the same library on a fresh cache: one compiles, the other
    waits for it and loads the same file (its compilers' CPU time: only `gcc --version`)."""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", _BUILD_AND_REPORT, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=kb.BUILD_TIMEOUT_S * 2)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0][0] == outs[1][0]  # the same library
    compile_s = sorted(float(out[1]) for out in outs)
    assert compile_s[0] < 1.0 < compile_s[1], compile_s
