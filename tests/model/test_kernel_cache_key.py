"""The cached kernel library's name covers the shared header (csrc/kernels_common.h): an edit to
it must rebuild, as an edit to a .c file does, or a stale library would run old helpers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardserve.model import native_kernels as nk

pytestmark = pytest.mark.skipif(
    not nk.compiler_available(), reason="no C compiler (SHARDSERVE_CC): PyTorch path only"
)

SOURCES = (nk.SOURCE, nk.QUANT_SOURCE, nk.ROWS_SOURCE, nk.TILES_SOURCE, nk.TILE_PANELS_SOURCE,
           nk.RETILE_SOURCE, nk.GEMM_SOURCE, nk.PANEL_SOURCE, nk.DECODE_SOURCE)


def _key() -> str:
    return nk._cache_key(shutil.which("gcc") or "gcc", nk.PORTABLE_ARCH, SOURCES)


@pytest.mark.parametrize("header", ["HEADER", "QUANT_HEADER"])
def test_a_header_edit_changes_the_cache_key(header: str, monkeypatch, tmp_path: Path) -> None:
    before = _key()
    original: Path = getattr(nk, header)
    edited = tmp_path / original.name
    edited.write_bytes(original.read_bytes() + b"\n/* edited */\n")
    monkeypatch.setattr(nk, header, edited)
    assert _key() != before


def test_the_header_is_included_by_every_source() -> None:
    """Each file takes the shared helpers from the header, none keeps its own copy."""
    for path in SOURCES:
        text = path.read_text()
        # Directly, or through the quantized sources' own header (which includes it).
        via = nk.HEADER if nk.QUANT_HEADER.name not in text else nk.QUANT_HEADER
        assert f'#include "{via.name}"' in text, path.name
        assert f'#include "{nk.HEADER.name}"' in nk.QUANT_HEADER.read_text()
        assert "static inline float bf16_to_f32" not in text, path.name
