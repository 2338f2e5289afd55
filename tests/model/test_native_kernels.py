"""The C kernels against plain PyTorch references, in the AVX-512 build and the portable build.

The references are written out here in the simplest PyTorch (a loop over requests, float32
softmax), not taken from the engine's own fallback path, so a shared mistake cannot hide.

These tests skip only where no compiler exists. A compiler that fails to build the source makes
`library()` None too, and that must fail here (the kernel tests call into a missing library, and
test_c_path_loads_where_a_compiler_exists says why), never turn into a skip.
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shardserve.model import native_kernels as nk
from shardserve.model.logits_controls import apply_token_bitmask_

pytestmark = [
    pytest.mark.skipif(not nk.compiler_available(),
                       reason="no C compiler (SHARDSERVE_CC): PyTorch path only"),
    pytest.mark.usefixtures("native_kernels_on"),  # tests/model/conftest.py
]

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: {"atol": 2e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


@pytest.fixture(params=["native", "portable"])
def kernels(request):
    """Run the test under each build: the one for this CPU, and the one without AVX-512."""
    if request.param == "native":
        yield
        return
    with nk.using(nk.build_library(nk.PORTABLE_ARCH)):
        yield


def reference_decode(q, cache, block_table, seq_lens):
    """softmax(q K^T / sqrt(D)) V per request over its first seq_len slots, in float32."""
    b, h, d = q.shape
    hkv, bs = cache.shape[3], cache.shape[1]
    flat = cache.view(-1, 2, hkv, d).float()
    out = []
    for r in range(b):
        pos = torch.arange(int(seq_lens[r]))
        slots = block_table[r][pos // bs] * bs + pos % bs
        k = flat[slots, 0].repeat_interleave(h // hkv, dim=1).transpose(0, 1)  # [H, L, D]
        v = flat[slots, 1].repeat_interleave(h // hkv, dim=1).transpose(0, 1)
        att = torch.softmax(q[r].float().unsqueeze(1) @ k.transpose(1, 2) / d**0.5, -1)
        out.append((att @ v).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 2, 16, 4), (8, 1, 32, 32), (4, 4, 8, 16), (6, 2, 48, 8), (16, 2, 128, 16)],
)
def test_decode_attention_matches_reference(
    kernels, dtype, heads, kv_heads, head_dim, block_size
) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + head_dim + block_size)
    b = 5
    seq_lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 70])
    width = int(-(-seq_lens.max() // block_size))
    num_blocks = b * width + 3
    # Stale huge values everywhere a request must not read: unused slots and blocks.
    cache = torch.full((num_blocks, block_size, 2, kv_heads, head_dim), 3e4).to(dtype)
    block_table = torch.randperm(num_blocks, generator=gen)[: b * width].view(b, width)
    for r in range(b):
        for p in range(int(seq_lens[r])):
            blk, off = block_table[r][p // block_size], p % block_size
            cache[blk, off] = torch.randn(2, kv_heads, head_dim, generator=gen).to(dtype)
    # Queries as strided rows of a wider buffer, picked out of order, as from a fused qkv.
    rows = torch.randn(2 * b, heads * head_dim + 7 * head_dim, generator=gen).to(dtype)
    q = rows[:, : heads * head_dim].view(2 * b, heads, head_dim)
    q_rows = torch.tensor([7, 0, 3, 9, 4])
    out = nk.decode_attention(q, cache, block_table, seq_lens, q_rows)
    ref = reference_decode(q[q_rows], cache, block_table, seq_lens)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (6, 2, 12)])
@pytest.mark.parametrize(("threads", "seq_lens"), [(2, [1000]), (4, [130]), (4, [700, 5])])
def test_decode_attention_splits_contexts_when_requests_are_fewer_than_threads(
    kernels, dtype, heads, kv_heads, head_dim, threads, seq_lens
) -> None:
    """Fewer requests than threads: each context runs as spans, one thread each, merged by
    their log-sum-exp (decode_attention.c). 1000 slots on 2 threads: 2 spans; 130 on 4: 2
    (spans of >= 64 slots); 700 and 5 on 4: 2 spans each, the short request's second empty.
    Against the reference, and against one thread (one span a request), in the AVX2 / AVX-512
    version (head size 64) and the portable one (12)."""
    gen = torch.Generator().manual_seed(sum(seq_lens) + head_dim)
    bs, b = 16, len(seq_lens)
    width = -(-max(seq_lens) // bs)
    cache = torch.full((b * width + 2, bs, 2, kv_heads, head_dim), 3e4)  # stale beyond the ends
    block_table = torch.randperm(b * width + 2, generator=gen)[: b * width].view(b, width)
    for r, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slots = block_table[r][pos // bs] * bs + pos % bs
        cache.view(-1, 2, kv_heads, head_dim)[slots] = torch.randn(n, 2, kv_heads, head_dim,
                                                                   generator=gen)
    cache = cache.to(dtype)
    q = torch.randn(b, heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        split = nk.decode_attention(q, cache, block_table, lens)
        torch.set_num_threads(1)
        whole = nk.decode_attention(q, cache, block_table, lens)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(split.float(), reference_decode(q, cache, block_table, lens),
                               **TOL[dtype])
    torch.testing.assert_close(split, whole, **TOL[dtype])


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (6, 2, 12), (16, 2, 128)])
@pytest.mark.parametrize(("threads", "seq_lens"), [(2, [700]), (2, [33, 1, 90])])
def test_decode_attention_reads_a_bfloat16_cache_under_float32_queries(
    kernels, heads, kv_heads, head_dim, threads, seq_lens
) -> None:
    """kv_cache_dtype="bfloat16": float32 queries and outputs over a bfloat16 cache. Every
    version widens the cache's values exactly and computes as over a float32 cache, so the output
    equals the same kernel's over that cache widened to float32, bit for bit, in whole contexts
    and in split ones (one request on 2 threads); and it meets the reference."""
    gen = torch.Generator().manual_seed(sum(seq_lens) + head_dim)
    bs, b = 16, len(seq_lens)
    width = -(-max(seq_lens) // bs)
    cache = torch.randn(b * width + 2, bs, 2, kv_heads, head_dim, generator=gen)
    cache = cache.to(torch.bfloat16)
    block_table = torch.randperm(b * width + 2, generator=gen)[: b * width].view(b, width)
    q = torch.randn(b, heads, head_dim, generator=gen)
    lens = torch.tensor(seq_lens)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = nk.decode_attention(q, cache, block_table, lens)
        widened = nk.decode_attention(q, cache.float(), block_table, lens)
    finally:
        torch.set_num_threads(before)
    assert out.dtype == torch.float32
    assert torch.equal(out, widened)
    torch.testing.assert_close(out, reference_decode(q, cache, block_table, lens),
                               **TOL[torch.float32])


def hf_rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm: float32 statistics, cast back, then times the weight."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 40])
def test_rms_norm_with_and_without_residual(kernels, dtype, hidden) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(6, hidden, generator=gen).to(dtype)
    residual = torch.randn(6, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    torch.testing.assert_close(nk.rms_norm(x, weight, 1e-5), hf_rms_norm(x, weight, 1e-5))
    summed = x + residual
    out = nk.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(residual, summed)  # updated in place, rounded as x + residual rounds
    torch.testing.assert_close(out, hf_rms_norm(summed, weight, 1e-5))
    # Strided rows (a column slice of a wider tensor).
    wide = torch.randn(6, hidden + 16, generator=gen).to(dtype)
    torch.testing.assert_close(
        nk.rms_norm(wide[:, :hidden], weight, 1e-5), hf_rms_norm(wide[:, :hidden], weight, 1e-5)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_interleaved_pairs(kernels, dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    t, heads, d = 5, 4, 16
    angles = torch.outer(torch.arange(40.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    table = torch.polar(torch.ones_like(angles), angles)  # complex64 [P, D/2]
    positions = torch.tensor([0, 3, 39, 7, 7])
    qkv = torch.randn(t, heads * d + 3 * d, generator=gen).to(dtype)
    x = qkv[:, : heads * d].view(t, heads, d)
    expected = torch.view_as_complex(x.float().reshape(t, heads, d // 2, 2).contiguous())
    expected = torch.view_as_real(expected * table[positions].unsqueeze(1)).reshape(t, heads, d)
    tail = qkv[:, heads * d :].clone()
    nk.rope_(x, positions, torch.view_as_real(table))
    torch.testing.assert_close(x.float(), expected, **TOL[dtype])
    assert torch.equal(qkv[:, heads * d :], tail)  # nothing outside x is touched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 24])
def test_silu_mul(kernels, dtype, inter) -> None:
    gen = torch.Generator().manual_seed(inter)
    gate_up = (4 * torch.randn(7, 2 * inter, generator=gen)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps and signs
    gate, up = gate_up.split(inter, dim=-1)
    expected = F.silu(gate) * up  # bf16: silu rounded, then the product rounded, as HF
    torch.testing.assert_close(nk.silu_mul(gate_up), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_write_matches_index_copy(kernels, dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(8, 4, 2, 3, 16, generator=gen).to(dtype)
    expected = cache.clone()
    qkv = torch.randn(5, 9 * 16 + 2 * 3 * 16, generator=gen).to(dtype)
    kv = qkv[:, 9 * 16 :].view(5, 2, 3, 16)
    slots = torch.tensor([31, 0, 5, 6, 17])
    expected.view(-1, 2, 3, 16).index_copy_(0, slots, kv)
    nk.cache_write(cache, kv, slots)
    assert torch.equal(cache, expected)


def test_cache_write_rounds_float32_rows_into_a_bfloat16_cache(kernels) -> None:
    """kv_cache_dtype="bfloat16": the step's float32 K/V rows land rounded to nearest even, as
    torch rounds (the values a bfloat16 model's cache would hold)."""
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(8, 4, 2, 3, 16, generator=gen).to(torch.bfloat16)
    expected = cache.clone()
    qkv = torch.randn(5, 9 * 16 + 2 * 3 * 16, generator=gen)
    kv = qkv[:, 9 * 16 :].view(5, 2, 3, 16)
    slots = torch.tensor([31, 0, 5, 6, 17])
    expected.view(-1, 2, 3, 16).index_copy_(0, slots, kv.to(torch.bfloat16))
    nk.cache_write(cache, kv, slots)
    assert torch.equal(cache, expected)


def _bitmask_case(vocab: int):
    """A random bitmask (one row all-allowed), logits, the rows it masks, and the expected."""
    gen = np.random.default_rng(vocab)
    bitmask = gen.integers(-(2**31), 2**31, size=(3, -(-vocab // 32))).astype(np.int32)
    bitmask[1, :] = -1
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    rows = [4, 0, 2]
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    expected = logits.clone()
    for r, row in enumerate(rows):
        expected[row, torch.from_numpy(allowed[r] == 0)] = float("-inf")
    return bitmask, logits, rows, expected


@pytest.mark.parametrize("vocab", [64, 70, 49152])
def test_apply_token_bitmask_masks_exactly_the_clear_bits(kernels, vocab) -> None:
    """Only the listed rows change, and in them exactly the tokens whose bit is clear (a
    partial last word included)."""
    bitmask, logits, rows, expected = _bitmask_case(vocab)
    assert nk.supports(torch.float32, logits.device)
    apply_token_bitmask_(logits, rows, bitmask)
    assert torch.equal(logits, expected)


def test_apply_token_bitmask_without_the_c_path(monkeypatch) -> None:
    monkeypatch.setenv("SHARDSERVE_NATIVE_KERNELS", "0")
    nk.library.cache_clear()
    bitmask, logits, rows, expected = _bitmask_case(70)
    assert not nk.supports(torch.float32, logits.device)
    apply_token_bitmask_(logits, rows, bitmask)
    assert torch.equal(logits, expected)


def test_bad_layouts_are_refused() -> None:
    cache = torch.zeros(4, 4, 2, 2, 16)
    with pytest.raises(ValueError, match="contiguous"):
        nk.decode_attention(
            torch.zeros(2, 4, 16), cache.transpose(0, 1), torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, dtype=torch.long),
        )
    with pytest.raises(ValueError, match="seq_lens must be an int64"):
        nk.decode_attention(
            torch.zeros(2, 4, 16), cache, torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="one slot's size"):
        nk.cache_write(cache, torch.zeros(3, 2, 1, 16), torch.zeros(3, dtype=torch.long))
    # A cache wider than the rows (float32 under bfloat16) is no pair the kernels take.
    with pytest.raises(ValueError, match="kv torch.bfloat16, cache torch.float32"):
        nk.cache_write(cache, torch.zeros(3, 2, 2, 16, dtype=torch.bfloat16),
                       torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="dtype mismatch"):
        nk.decode_attention(torch.zeros(2, 4, 16, dtype=torch.bfloat16), cache,
                            torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long))


def test_without_a_compiler_everything_falls_back(monkeypatch, tmp_path, caplog) -> None:
    """No compiler (and nothing cached): one warning, supports() is False, the model still runs."""
    monkeypatch.setenv("SHARDSERVE_CC", "no-such-compiler-shardserve")
    monkeypatch.setenv("SHARDSERVE_CACHE_DIR", str(tmp_path))
    nk.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="shardserve.model.native_kernels"):
            assert not nk.supports(torch.float32, torch.device("cpu"))
        assert "no-such-compiler-shardserve" in caplog.text
        assert "PyTorch path" in caplog.text
    finally:
        monkeypatch.undo()
        nk.library.cache_clear()
    assert nk.library() is not None


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the C kernels are tuned for x86-64"
)
def test_c_path_loads_where_a_compiler_exists() -> None:
    """With a compiler on an x86-64 CPU the model must run C: a None here is a build failure
    (its compiler output is in the log), not an environment without C."""
    assert nk.library() is not None, "the C kernels failed to build; see the logged error"
    for dtype in DTYPES:
        assert nk.supports(dtype, torch.device("cpu"))


def _broken_copy(folder: Path) -> Path:
    broken = folder / "cpu_kernels.c"
    broken.write_text(nk.SOURCE.read_text() + "\nint shardserve_broken(void) { return 1 }\n")
    return broken


def test_a_broken_source_is_a_build_error(tmp_path) -> None:
    """A compile error raises with the compiler's message, and nothing is cached for it."""
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match=r"(?s)failed:.*error.*shardserve_broken"):
        nk.build_library(nk.PORTABLE_ARCH, source=_broken_copy(tmp_path), cache_dir=cache)
    assert list(cache.rglob("*.so")) == []
    # The real source builds at the same level (the suite's cached build; a fresh one is
    # test_kernel_levels.py's): the failure above was the source's.
    assert nk.build_library(nk.PORTABLE_ARCH) is not None


def test_a_failed_build_is_logged_as_an_error(monkeypatch, tmp_path, caplog) -> None:
    """library() still falls back (the model runs), but says so at ERROR with gcc's output."""
    monkeypatch.setattr(nk, "SOURCE", _broken_copy(tmp_path))
    monkeypatch.setenv("SHARDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    nk.library.cache_clear()
    with caplog.at_level(logging.WARNING, logger="shardserve.model.native_kernels"):
        assert nk.library() is None
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "failed to build" in errors[0].getMessage()
    assert "shardserve_broken" in errors[0].getMessage()  # the compiler's diagnostic
