"""csrc/lora_kernels.c (native_kernels.lora_add_) against a float64 reference: the adapters'
share of a projection, per token by its slot, merged layers' parts in their own blocks."""

from __future__ import annotations

import platform

import pytest
import torch

from shardserve.model import native_kernels as nk

pytestmark = pytest.mark.skipif(
    not nk.compiler_available(), reason="no C compiler (SHARDSERVE_CC): PyTorch path only"
)


# x86-64-v3 is AVX2 + FMA: what an AVX-512 machine builds to check the other ISA level.
BUILDS = {"native": None, "avx2": ("-march=x86-64-v3",), "portable": nk.PORTABLE_ARCH}


@pytest.fixture(params=list(BUILDS))
def kernels(request, monkeypatch):
    """The build for this CPU, the AVX2 one, and the portable one (a CPU without AVX2)."""
    monkeypatch.delenv("SHARDSERVE_NATIVE_KERNELS", raising=False)
    nk.library.cache_clear()
    flags = BUILDS[request.param]
    if flags is None or platform.machine() not in ("x86_64", "AMD64") and flags != ():
        yield
    else:
        with nk.using(nk.build_library(flags)):
            yield
    nk.library.cache_clear()


def _reference(out, x, slots, a, bt, seg_ends):
    """out + per token: (bt[s] restricted to its parts' blocks)^T (a[s] x), in float64."""
    want = out.double().clone()
    parts, rank = len(seg_ends), a.shape[1]
    start = 0
    for j, end in enumerate(seg_ends):
        rows = slice(j * rank // parts, (j + 1) * rank // parts)
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                u = a[s, rows].double() @ x[t].double()
                want[t, start:end] += u @ bt[s, rows, start:end].double()
        start = end
    return want


CASES = [  # tokens, K, parts' output ends, rank (all parts), slots (-1: base)
    (1, 64, [64], 8, [0]),
    (7, 96, [96, 128, 160], 24, [0, -1, 2, 1, 0, -1, 2]),  # q|k|v as qkv_proj stacks them
    (5, 160, [300, 600], 16, [1, 1, 1, 1, 1]),  # gate|up, N not a multiple of the blocks
    (4, 32, [70], 4, [-1, -1, -1, -1]),  # no adapted token: out unchanged
]


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32),
                                          (torch.bfloat16, torch.float32),
                                          (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-N{c[2][-1]}-R{c[3]}")
def test_matches_reference(kernels, case, dtype, wdtype):
    t, k, seg_ends, rank, slots = case
    g = torch.Generator().manual_seed(t * 1000 + k)
    n, s = seg_ends[-1], 3
    x = torch.randn(t, k, generator=g).to(dtype)
    out = torch.randn(t, n, generator=g).to(dtype)
    a = (torch.randn(s, rank, k, generator=g) / k**0.5).to(wdtype)
    bt = (torch.randn(s, rank, n, generator=g) * 0.1).to(wdtype)
    slots_t = torch.tensor(slots, dtype=torch.int32)
    want = _reference(out, x, slots_t, a, bt, seg_ends)
    got = out.clone()
    nk.lora_add_(got, x, slots_t, a.transpose(1, 2).contiguous(), bt, torch.tensor(seg_ends))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    if any(v >= 0 for v in slots):
        assert not torch.equal(got, out)  # the adapters changed something
    base = [i for i, v in enumerate(slots) if v < 0]
    assert torch.equal(got[base], out[base])  # base tokens untouched, bit for bit


def test_a_tokens_result_does_not_depend_on_its_batch(kernels):
    """Batch invariance: token 0's row alone equals its row inside a batch of 33 (other slots,
    enough work to run on every thread)."""
    g = torch.Generator().manual_seed(3)
    k, n, rank = 576, 1536, 32
    x = torch.randn(33, k, generator=g)
    at, bt = torch.randn(4, k, rank, generator=g), torch.randn(4, rank, n, generator=g)
    segs = torch.tensor([768, 1536])
    slots = (torch.arange(33) % 4).to(torch.int32)
    batch = torch.zeros(33, n)
    nk.lora_add_(batch, x, slots, at, bt, segs)
    alone = torch.zeros(1, n)
    nk.lora_add_(alone, x[:1], slots[:1], at, bt, segs)
    assert torch.equal(alone[0], batch[0])


def test_refuses_bad_arguments(kernels):
    x, out = torch.zeros(2, 8), torch.zeros(2, 12)
    at, bt = torch.zeros(1, 8, 4), torch.zeros(1, 4, 12)
    slots = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="segments"):
        nk.lora_add_(out, x, slots, at, bt, torch.tensor([5, 12], dtype=torch.int64)[:1])
    with pytest.raises(ValueError, match="do not fit"):
        nk.lora_add_(out, x, slots.long(), at, bt, torch.tensor([12]))
