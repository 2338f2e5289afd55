"""Broadcast-and-reply round trip: shardserve MessageQueue vs multiprocessing and ZMQ.

One writer (this process) sends a numpy uint8 payload (or, with --payload bytes, the `bytes` of
../shared/bench/mq_peer_bench.py) to 2 reader processes; each answers with a
small reply through its own channel; one step = send + both replies. For every transport and
payload size we report median and p99 latency (us), steps/s, the CPU used during the timed
steps (user+sys of all three processes / wall time, in cores), and, once per transport, the CPU
each reader burns while blocked in its receive call for IDLE_S seconds. mp.Pipe here is a duplex
Pipe (a Unix socketpair, whose buffers hold far more than the one-way os.pipe of
../shared/bench/mq_peer_bench.py): the two agree at 1 and 16 KiB, this one is faster from 256 KiB.
All transports stay up and are measured in turn, --rounds times, each cell for --seconds; the
rounds are pooled.

    .venv/bin/python bench/ipc.py [--rounds 4] [--seconds 0.25]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import time
from typing import Any

import numpy as np
import psutil
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shardserve.ipc import MessageQueueReader, MessageQueueWriter  # noqa: E402

SIZES = [1 << 10, 16 << 10, 256 << 10, 4 << 20]
N_READERS = 2
IDLE_S = 2.0
WARMUP = 30
MAX_STEPS = 3000


# ---- reader processes (one function per transport; None = stop) --------------------------------


def _mq_reader(handle: Any, rank: int, setup: Any) -> None:
    bcast = MessageQueueReader.from_handle(handle, rank, name=f"bench-bcast-{rank}")
    resp = MessageQueueWriter(1, 1, max_chunk_bytes=1 << 16, max_chunks=4,
                              name=f"bench-resp-{rank}")
    setup.send(resp.export_handle())
    bcast.wait_until_ready(timeout=30)
    resp.wait_until_ready(timeout=30)
    while (msg := bcast.dequeue()) is not None:
        resp.enqueue(len(msg))
    bcast.close()
    resp.close()


def _queue_reader(inq: Any, outq: Any) -> None:
    while (msg := inq.get()) is not None:
        outq.put(len(msg))


def _pipe_reader(conn: Any) -> None:
    while (msg := pickle.loads(conn.recv_bytes())) is not None:
        conn.send_bytes(pickle.dumps(len(msg)))


def _zmq_reader(sub_addr: str, push_addr: str) -> None:
    ctx = zmq.Context()
    sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(sub_addr)
    push.connect(push_addr)
    while True:
        frames = sub.recv_multipart(copy=False)
        msg = pickle.loads(frames[0].buffer, buffers=[f.buffer for f in frames[1:]])
        if msg is None:
            break
        push.send(pickle.dumps(len(msg)))
    ctx.destroy(linger=0)


# ---- writer-side transports ------------------------------------------------------------------


class Transport:
    name = ""
    procs: list[mp.Process]

    def step(self, payload: Any) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


class MQTransport(Transport):
    name = "shardserve MQ"

    def __init__(self, ctx: Any) -> None:
        self.bcast = MessageQueueWriter(N_READERS, N_READERS, max_chunk_bytes=(4 << 20) + 4096,
                                        max_chunks=4, name="bench-bcast")
        pipes = [ctx.Pipe() for _ in range(N_READERS)]
        self.procs = [ctx.Process(target=_mq_reader, args=(self.bcast.export_handle(), r, c))
                      for r, (_, c) in enumerate(pipes)]
        for p in self.procs:
            p.start()
        self.resps = [MessageQueueReader.from_handle(p.recv(), 0) for p, _ in pipes]
        self.bcast.wait_until_ready(timeout=30)
        for q in self.resps:
            q.wait_until_ready(timeout=30)

    def step(self, payload: Any) -> None:
        self.bcast.enqueue(payload)
        for q in self.resps:
            q.dequeue()

    def stop(self) -> None:
        self.bcast.enqueue(None)
        super().stop()
        self.bcast.close()
        for q in self.resps:
            q.close()


class QueueTransport(Transport):
    name = "mp.Queue"

    def __init__(self, ctx: Any) -> None:
        self.inqs = [ctx.Queue() for _ in range(N_READERS)]
        self.outqs = [ctx.Queue() for _ in range(N_READERS)]
        self.procs = [ctx.Process(target=_queue_reader, args=qs)
                      for qs in zip(self.inqs, self.outqs, strict=True)]
        for p in self.procs:
            p.start()

    def step(self, payload: Any) -> None:
        for q in self.inqs:
            q.put(payload)
        for q in self.outqs:
            q.get()

    def stop(self) -> None:
        for q in self.inqs:
            q.put(None)
        super().stop()


class PipeTransport(Transport):
    name = "mp.Pipe"

    def __init__(self, ctx: Any) -> None:
        pairs = [ctx.Pipe() for _ in range(N_READERS)]
        self.conns = [a for a, _ in pairs]
        self.procs = [ctx.Process(target=_pipe_reader, args=(b,)) for _, b in pairs]
        for p in self.procs:
            p.start()

    def step(self, payload: Any) -> None:
        data = pickle.dumps(payload, protocol=5)  # once, like a broadcast (and the harness)
        for c in self.conns:
            c.send_bytes(data)
        for c in self.conns:
            c.recv_bytes()

    def stop(self) -> None:
        for c in self.conns:
            c.send_bytes(pickle.dumps(None))
        super().stop()


class ZMQTransport(Transport):
    name = "ZMQ ipc://"

    def __init__(self, ctx: Any) -> None:
        self.zctx = zmq.Context()
        self.pub = self.zctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report both readers' identical subscriptions
        self.pub.setsockopt(zmq.RCVTIMEO, 30_000)
        base = f"ipc:///tmp/shardserve-bench-{os.getpid()}"
        self.pub.bind(f"{base}-pub")
        self.pulls = []
        for r in range(N_READERS):
            pull = self.zctx.socket(zmq.PULL)
            pull.setsockopt(zmq.RCVTIMEO, 30_000)
            pull.bind(f"{base}-pull{r}")
            self.pulls.append(pull)
        self.procs = [ctx.Process(target=_zmq_reader, args=(f"{base}-pub", f"{base}-pull{r}"))
                      for r in range(N_READERS)]
        for p in self.procs:
            p.start()
        for _ in range(N_READERS):  # XPUB: one subscription message per connected reader
            self.pub.recv()

    def step(self, payload: Any) -> None:
        bufs: list[Any] = []
        main = pickle.dumps(payload, protocol=5, buffer_callback=bufs.append)
        self.pub.send_multipart([main, *(b.raw() for b in bufs)], copy=False)
        for pull in self.pulls:
            pickle.loads(pull.recv())

    def stop(self) -> None:
        self.pub.send_multipart([pickle.dumps(None)])
        super().stop()
        self.zctx.destroy(linger=0)
        for f in os.listdir("/tmp"):
            if f.startswith(f"shardserve-bench-{os.getpid()}"):
                os.unlink(os.path.join("/tmp", f))


# ---- measurement -----------------------------------------------------------------------------


def _cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def measure(tr: Transport, size: int, seconds: float, kind: str) -> dict[str, Any]:
    """One timed cell: raw latencies (s), wall time and CPU seconds of all three processes."""
    payload: Any = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    if kind == "bytes":
        payload = payload.tobytes()
    for _ in range(WARMUP):
        tr.step(payload)
    everyone = [psutil.Process()] + [psutil.Process(p.pid) for p in tr.procs]
    lat: list[float] = []
    cpu0, t0 = _cpu(everyone), time.perf_counter()
    while len(lat) < MAX_STEPS and time.perf_counter() - t0 < seconds:
        s = time.perf_counter()
        tr.step(payload)
        lat.append(time.perf_counter() - s)
    return {"lat": lat, "wall": time.perf_counter() - t0, "cpu": _cpu(everyone) - cpu0}


def summarize(cells: list[dict[str, Any]]) -> dict[str, float]:
    """Pool the rounds of one (transport, size): median/p99 over every step, CPU over all time."""
    lat = sorted(x for c in cells for x in c["lat"])
    wall = sum(c["wall"] for c in cells)
    return {"median": statistics.median(lat) * 1e6, "p99": lat[int(len(lat) * 0.99)] * 1e6,
            "steps": len(lat) / wall, "cores": sum(c["cpu"] for c in cells) / wall}


def idle_cpu(tr: Transport) -> float:
    readers = [psutil.Process(p.pid) for p in tr.procs]
    before = [_cpu([p]) for p in readers]
    time.sleep(IDLE_S)
    return max(_cpu([p]) - b for p, b in zip(readers, before, strict=True)) / IDLE_S


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=0.25, help="timed seconds per cell")
    ap.add_argument("--rounds", type=int, default=4, help="rounds over every transport")
    ap.add_argument("--only", default="", help="comma-separated transport class names")
    ap.add_argument("--payload", choices=("numpy", "bytes"), default="numpy",
                    help="bytes: the payload of ../shared/bench/mq_peer_bench.py")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    only = set(args.only.split(",")) if args.only else None
    classes = [c for c in (MQTransport, PipeTransport, ZMQTransport, QueueTransport)
               if not only or c.__name__ in only]
    # Every transport stays up (idle readers sleep) and the cells are taken in turn, round after
    # round: this VM's speed drifts by tens of percent over a minute, and one-after-another runs
    # would compare the drift, not the transports.
    transports: list[Transport] = []
    try:
        for cls in classes:
            transports.append(cls(ctx))
        cells: dict[str, dict[int, list[dict[str, Any]]]] = {
            tr.name: {s: [] for s in SIZES} for tr in transports}
        for rnd in range(args.rounds):
            for size in SIZES:
                for tr in transports:
                    cell = measure(tr, size, args.seconds, args.payload)
                    cells[tr.name][size].append(cell)
                    print(f"  round {rnd + 1}/{args.rounds} {tr.name} {size} B: median "
                          f"{statistics.median(cell['lat']) * 1e6:.1f} us", file=sys.stderr,
                          flush=True)
        results = {name: {s: summarize(c) for s, c in by_size.items()}
                   for name, by_size in cells.items()}
        idle = {tr.name: idle_cpu(tr) for tr in transports}
    finally:
        for tr in transports:
            tr.stop()
    report(results, idle, args.payload)


def report(results: dict[str, dict[int, dict[str, float]]], idle: dict[str, float],
           payload: str) -> None:
    ours = results.get("shardserve MQ")
    print(f"cores available: {len(os.sched_getaffinity(0))}; {N_READERS} readers; "
          f"payload = {'numpy uint8 array' if payload == 'numpy' else 'bytes'}; reply = int")
    print(f"{'transport':<14} {'size':>7} {'median us':>10} {'p99 us':>9} {'steps/s':>8} "
          f"{'CPU cores':>9} {'ratio':>6}")
    for name, rows in results.items():
        for size, r in rows.items():
            ratio = r["median"] / ours[size]["median"] if ours else float("nan")
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            print(f"{name:<14} {label:>7} {r['median']:>10.1f} {r['p99']:>9.1f} "
                  f"{r['steps']:>8.0f} {r['cores']:>9.2f} {ratio:>6.2f}")
    print("ratio = transport median / shardserve median (> 1: shardserve is faster)")
    print(f"idle CPU per reader (blocked in receive for {IDLE_S:.0f} s, worst reader):")
    for name, frac in idle.items():
        print(f"  {name:<14} {frac * 100:6.2f} % of a core")


if __name__ == "__main__":
    main()
