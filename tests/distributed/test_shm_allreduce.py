"""The shared-memory all-reduce sums what gloo would (all-gather: exactly), and leaves no segment
behind."""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from shardserve.distributed import parallel_state

# Sums in a different order differ by rounding only: up to a couple of bf16 ulps at ~100.
_ATOL = {torch.float32: 1e-4, torch.bfloat16: 1.0}


def _run(rank: int, world: int, store: str, results) -> None:
    group = parallel_state.init_distributed(rank, world, f"file://{store}", "gloo")
    assert group.shm is not None
    torch.manual_seed(rank)
    checks = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for shape in ((1, 576), (32, 576), (7,), (1200, 1200)):  # the last exceeds a slot: gloo
            t = (torch.randn(shape) * 10).to(dtype)
            expected = t.clone()
            torch.distributed.all_reduce(expected)
            for _ in range(3):  # reuse both buffers
                got = group.all_reduce(t.clone())
            checks.append(
                bool(torch.equal(got, expected))
                if dtype == torch.int64
                else bool(
                    torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=_ATOL[dtype])
                )
            )
    for shape in ((1, 100), (32, 24576), (7, 1200, 1200)):  # logits-sized; the last is gloo's
        t = torch.randn(shape) + rank
        parts = [torch.empty_like(t) for _ in range(world)]
        torch.distributed.all_gather(parts, t)
        for _ in range(3):
            got = group.all_gather(t.clone(), dim=-1)
        checks.append(bool(torch.equal(got, torch.cat(parts, dim=-1))))
    results[rank] = checks
    parallel_state.destroy_distributed()


def test_shm_allreduce_matches_gloo(tmp_path):
    world = 3
    before = {n for n in os.listdir("/dev/shm") if "shardserve-ar" in n}
    results = mp.Manager().dict()
    mp.spawn(_run, args=(world, str(tmp_path / "store"), results), nprocs=world, join=True)
    assert {r: all(c) for r, c in results.items()} == {0: True, 1: True, 2: True}, dict(results)
    assert {n for n in os.listdir("/dev/shm") if "shardserve-ar" in n} == before
