"""The opt-in int8 activations of the row kernels (csrc/quant_rows_int8.c,
SHARDSERVE_INT8_ACTIVATIONS) on every ISA level, against an oracle that quantizes x to int8 per
32 values in Python (the largest magnitude -> 127, products rounded to nearest even) and
multiplies the dequantized x with the gguf package's dequantized weights in float64. The kernels'
integer sums are exact, so they agree to float32 rounding (1e-5 of the largest output); the int16
rows miss that oracle by ~5e-3 (asserted too: the test sees which mode ran)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_quantization import ARCHES, random_blocks, reference, rel_err

from shardserve.model import native_kernels as nk
from shardserve.model import quant_types as qt
from shardserve.model import quantization as q

pytestmark = pytest.mark.skipif(not nk.compiler_available(), reason="no C compiler")

INT8_TYPES = [2, 3, 8, 12, 13, 14]  # every block layout; tiles and repacked rows keep int16


def int8_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: per 32 values q = round(x * (127 / amax)), times amax / 127, each
    step one float32 operation (numpy's; torch's broadcast multiply rounded one tie of these
    tests the other way, as if in higher precision)."""
    blocks = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127.0) / np.maximum(amax, np.float32(1e-30)),
                   np.float32(0.0)).astype(np.float32)
    ints = np.rint(blocks * inv)  # to nearest even, as the kernels' conversion
    scale = (amax / np.float32(127.0)).astype(np.float32)
    return torch.from_numpy(ints.astype(np.float64) * scale.astype(np.float64)).reshape(x.shape)


@pytest.fixture(scope="module", params=list(ARCHES))
def level(request):
    lib = nk.build_library(ARCHES[request.param])
    with nk.using(lib):
        lib.quant_set_int8_activations(1)
        try:
            yield lib
        finally:
            lib.quant_set_int8_activations(0)


@pytest.mark.parametrize("ggml_type", INT8_TYPES, ids=[qt.GGML_TYPES[t][0] for t in INT8_TYPES])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11])  # every NB kernel, and two passes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_int8_rows_equal_the_int8_oracle(level, ggml_type, rows, dtype):
    w = random_blocks(ggml_type, 40, 768, seed=ggml_type + rows)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)).to(dtype)
    out = torch.empty(rows, 40)
    q.matmul_into(out, x, w)
    want_w = reference(w).double()
    assert rel_err(out, int8_x(x) @ want_w.T) < 1e-5
    assert rel_err(out, x.double() @ want_w.T) > 1e-4  # int8's rounding: not the int16 rows


def test_the_mode_switches_back_to_the_int16_rows_bit_for_bit(level):
    w = random_blocks(12, 48, 512, seed=3)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(4))
    int8 = torch.empty(2, 48)
    q.matmul_into(int8, x, w)
    level.quant_set_int8_activations(0)
    try:
        int16 = torch.empty(2, 48)
        q.matmul_into(int16, x, w)
    finally:
        level.quant_set_int8_activations(1)
    again = torch.empty(2, 48)
    q.matmul_into(again, x, w)
    assert torch.equal(int8, again) and not torch.equal(int8, int16)
    assert rel_err(int16, x.double() @ reference(w).double().T) < 1e-4


def test_the_environment_variable_turns_it_on_and_says_so():
    code = ("from shardserve.model import native_kernels as nk; "
            "print('mode', nk.library().quant_int8_activations())")
    env = dict(os.environ, SHARDSERVE_INT8_ACTIVATIONS="1", SHARDSERVE_ISA="avx2")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    assert "mode 1" in done.stdout
    assert "SHARDSERVE_INT8_ACTIVATIONS=1" in done.stderr and "int8" in done.stderr
