"""ShmPipe between two real processes: messages arrive intact and in order, the sender runs up
to NUM_SLOTS messages ahead of a slow receiver, oversized messages are refused on both sides
alike, and a wait for a peer that never sends ends with a TimeoutError."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from shardserve.distributed.shm_pipe import ShmPipe

N_MESSAGES = 40


def _shapes(i: int) -> list[tuple[int, int]]:
    rows = 1 + (i * 7) % 23
    return [(rows, 16), (rows, 16)]


def _payload(i: int) -> list[torch.Tensor]:
    return [torch.full(s, float(i * 10 + k)) + torch.arange(s[1]) for k, s in enumerate(_shapes(i))]


def _receiver(name: str, delay_first_s: float, result) -> None:
    pipe = ShmPipe(name, create=False, timeout_s=30)
    time.sleep(delay_first_s)  # the sender must be able to run ahead meanwhile
    try:
        for i in range(N_MESSAGES):
            got = pipe.recv(_shapes(i), torch.float32)
            assert got is not None
            for a, b in zip(got, _payload(i), strict=True):
                assert torch.equal(a, b), f"message {i} differs"
        result.put("ok")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result.put(repr(e))
    finally:
        pipe.close()


def test_messages_cross_in_order_and_the_sender_runs_ahead():
    name = ShmPipe.new_name()
    pipe = ShmPipe(name, create=True, slot_bytes=64 << 10, timeout_s=30)
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    child = ctx.Process(target=_receiver, args=(name, 1.0, result))
    child.start()
    try:
        t0 = time.monotonic()
        for i in range(ShmPipe.NUM_SLOTS):
            assert pipe.send(_payload(i))
        # NUM_SLOTS messages went out while the receiver slept (it sleeps 1 s before reading).
        assert time.monotonic() - t0 < 0.9
        for i in range(ShmPipe.NUM_SLOTS, N_MESSAGES):
            assert pipe.send(_payload(i))
        assert result.get(timeout=60) == "ok"
    finally:
        child.join(timeout=30)
        pipe.unlink()
        pipe.close()
    assert child.exitcode == 0
    assert not os.path.exists(f"/dev/shm/{name}")


def test_too_big_is_refused_alike_on_both_sides():
    name = ShmPipe.new_name()
    sender = ShmPipe(name, create=True, slot_bytes=1024, timeout_s=1)
    receiver = ShmPipe(name, create=False, timeout_s=1)
    sender.unlink()
    try:
        big = [torch.zeros(200, 2)]  # 1600 bytes > 1024
        assert sender.send(big) is False
        assert receiver.recv([(200, 2)], torch.float32) is None
        small = [torch.ones(10, 2)]
        assert sender.send(small)
        assert torch.equal(receiver.recv([(10, 2)], torch.float32)[0], small[0])
    finally:
        sender.close()
        receiver.close()


def test_waiting_for_a_silent_peer_times_out():
    name = ShmPipe.new_name()
    sender = ShmPipe(name, create=True, slot_bytes=1024, timeout_s=0.3)
    receiver = ShmPipe(name, create=False, timeout_s=0.3)
    sender.unlink()
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="previous stage"):
            receiver.recv([(4, 4)], torch.float32)
        assert time.monotonic() - t0 < 10  # bounded (a hang-catcher, not a speed claim)
        for _ in range(ShmPipe.NUM_SLOTS):  # a sender with no reader fills every slot...
            assert sender.send([torch.ones(4, 4)])
        with pytest.raises(TimeoutError, match="free a slot"):  # ...and then waits, bounded
            sender.send([torch.ones(4, 4)])
    finally:
        sender.close()
        receiver.close()
