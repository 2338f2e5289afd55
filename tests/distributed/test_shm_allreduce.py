"""The shared-memory collectives at the sizes the model uses: they take the shared-memory path
(the group's counters say which path ran), sum what gloo would (all-gather: exactly), fall back
to gloo for what does not fit, and leave no segment behind."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from shardserve.distributed import parallel_state
from shardserve.distributed.shm_allreduce import ShmAllReduce
from tests.conftest import our_segments

WORLD = 3  # TP=3: the default model's 49152-entry vocab splits into 16384 columns per rank
HIDDEN = 576  # the default model's hidden size: every layer all-reduces [tokens, 576]
VOCAB_PER_RANK = 49152 // WORLD
# Sums in a different order differ by rounding only: up to a couple of bf16 ulps at ~100.
_ATOL = {torch.float32: 1e-4, torch.bfloat16: 1.0}
FLOATS = (torch.float32, torch.bfloat16)


def _collective(
    group: parallel_state.GroupCoordinator, op: str, t: torch.Tensor, path: str, errors: list[str]
) -> torch.Tensor:
    """group.<op> on a copy of t (all_gather: along the last dim); records an error unless
    exactly one collective ran, on `path` ("shm" or "gloo")."""
    label = f"{op} {tuple(t.shape)} {t.dtype}"
    before = group.shm_calls, group.fallback_calls
    out = group.all_reduce(t.clone()) if op == "all_reduce" else group.all_gather(t.clone(), -1)
    took = group.shm_calls - before[0], group.fallback_calls - before[1]
    if took != ((1, 0) if path == "shm" else (0, 1)):
        errors.append(f"{label}: expected the {path} path, took (shm, gloo) calls {took}")
    return out


def _all_reduce_checks(group, rank: int, errors: list[str]) -> None:
    # One token (decode), a batch of decodes, a full max_num_batched_tokens=2048 prefill step.
    for dtype in (*FLOATS, torch.int64):
        # int64 (exact sums) only at small sizes: the model never reduces it at all.
        shapes = [(1, HIDDEN), (32, HIDDEN), (7,)] + [(2048, HIDDEN)] * (dtype in FLOATS)
        for shape in shapes:
            t = (torch.randn(shape) * 10).to(dtype)
            expected = t.clone()
            torch.distributed.all_reduce(expected)
            for _ in range(3):  # reuse both buffers
                got = _collective(group, "all_reduce", t, "shm", errors)
            ok = (
                torch.equal(got, expected)
                if dtype == torch.int64
                else torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=_ATOL[dtype])
            )
            if not ok:
                errors.append(f"all_reduce {shape} {dtype}: differs from gloo")


def _all_gather_checks(group, rank: int, errors: list[str]) -> None:
    # A decode step's logits, [rows, vocab / TP] per rank, up to max_num_seqs=128 rows.
    for dtype in FLOATS:
        for rows in (1, 32, 64, 128):
            t = (torch.randn(rows, VOCAB_PER_RANK) + rank).to(dtype)
            parts = [torch.empty_like(t) for _ in range(WORLD)]
            torch.distributed.all_gather(parts, t)
            for _ in range(3):
                got = _collective(group, "all_gather", t, "shm", errors)
            if not torch.equal(got, torch.cat(parts, dim=-1)):
                errors.append(f"all_gather ({rows}, {VOCAB_PER_RANK}) {dtype}: differs from gloo")


def _fallback_checks(group, rank: int, errors: list[str]) -> None:
    """One element more than a slot holds goes to gloo, and still gives gloo's exact result."""
    too_big = group.shm.slot_bytes // 8 + 1  # int64 / float64 elements
    t = torch.arange(too_big, dtype=torch.int64) * (rank + 1)
    got = _collective(group, "all_reduce", t, "gloo", errors)
    if not torch.equal(got, torch.arange(too_big) * sum(range(1, WORLD + 1))):
        errors.append("all_reduce too big: wrong sum")
    t = torch.randn(too_big, dtype=torch.float64) + rank
    parts = [torch.empty_like(t) for _ in range(WORLD)]
    torch.distributed.all_gather(parts, t)
    got = _collective(group, "all_gather", t, "gloo", errors)
    if not torch.equal(got, torch.cat(parts)):
        errors.append("all_gather too big: differs from gloo")
    # The next call that fits is back on the shared-memory path.
    _collective(group, "all_reduce", torch.ones(HIDDEN), "shm", errors)


SECTIONS = {"all_reduce": _all_reduce_checks, "all_gather": _all_gather_checks,
            "fallback": _fallback_checks}


def _run(rank: int, store: str, results) -> None:
    group = parallel_state.init_distributed(rank, WORLD, f"file://{store}", "gloo")
    torch.manual_seed(rank)
    for name, checks in SECTIONS.items():
        errors: list[str] = []
        if group.shm is None:
            errors.append("no shared-memory segment: every collective would go through gloo")
        else:
            checks(group, rank, errors)
        results[(name, rank)] = errors
    parallel_state.destroy_distributed()


@pytest.fixture(scope="module")
def rank_errors(tmp_path_factory) -> dict[tuple[str, int], list[str]]:
    """Every section's errors per rank, from one run of WORLD processes (start-up is the cost)."""
    before = {n for n in our_segments() if "shardserve-ar" in n}
    results = mp.Manager().dict()
    store = str(tmp_path_factory.mktemp("shm") / "store")
    mp.spawn(_run, args=(store, results), nprocs=WORLD, join=True)
    # The segment is unlinked once mapped: nothing is left, whatever the checks found.
    assert {n for n in our_segments() if "shardserve-ar" in n} == before
    return dict(results)


@pytest.mark.parametrize("section", list(SECTIONS))
def test_shm_collectives_at_model_sizes(rank_errors, section: str) -> None:
    assert {r: rank_errors[(section, r)] for r in range(WORLD)} == {r: [] for r in range(WORLD)}


def test_slots_hold_the_default_models_largest_gather() -> None:
    """max_num_seqs (128) rows of the 49152-entry vocab in float32, split over any TP size."""
    for world in (2, 3, 4, 6, 8):
        needed = 128 * (49152 // world) * 4
        assert ShmAllReduce.slot_bytes_for(world, ShmAllReduce.BUFFER_BYTES) >= needed, world


def test_attaching_ranks_take_the_creators_size() -> None:
    """Where /dev/shm is short the creator picks smaller buffers; the others read its size."""
    name = ShmAllReduce.new_name()
    small = ShmAllReduce.MIN_BUFFER_BYTES
    creator = ShmAllReduce(0, WORLD, name, create=True, buffer_bytes=small)
    try:
        other = ShmAllReduce(1, WORLD, name, create=False)
        assert other.slot_bytes == creator.slot_bytes == ShmAllReduce.slot_bytes_for(WORLD, small)
        other.close()
    finally:
        creator.unlink()
        creator.close()
