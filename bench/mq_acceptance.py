"""Issue 12's acceptance from ../shared/bench/mq_peer_bench.py --json files: per size, our median
round trip and CPU per message (all processes' CPU-seconds per step) as ratios of vLLM's in the
same run, idle reader CPU, cold round trip, bad replies.

    .venv/bin/python bench/mq_acceptance.py run1.json [run2.json ...]
"""

from __future__ import annotations

import json
import sys

PEER = "vllm.distributed.device_communicators.shm_broadcast"
# Ours: the --impl name today, and the one of runs recorded before the queue had a type per end.
OURS = ("bench.mq_vllm_api", "shardserve.ipc")


def _by_impl(path: str) -> dict[str, dict]:
    with open(path) as f:
        return {r["impl"]: r for r in json.load(f)["results"]}


def table(path: str) -> bool:
    res = _by_impl(path)
    ours, peer = next(res[name] for name in OURS if name in res), res[PEER]
    ok = True
    print(f"\n{path}\n| size | vLLM us | ours us | latency ratio | vLLM CPU us/msg | "
          f"ours CPU us/msg | CPU ratio | bad |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for o, p in zip(ours["sizes"], peer["sizes"], strict=True):
        cpu_o = o["cpu_total_cores"] / o["steps_per_s"] * 1e6
        cpu_p = p["cpu_total_cores"] / p["steps_per_s"] * 1e6
        lat, cpu = o["median_us"] / p["median_us"], cpu_o / cpu_p
        ok &= lat <= 0.8 and cpu <= 0.6 and o["bad_replies"] == 0
        print(f"| {o['size_h']} | {p['median_us']:.1f} | {o['median_us']:.1f} | {lat:.2f} | "
              f"{cpu_p:.0f} | {cpu_o:.0f} | {cpu:.2f} | {o['bad_replies']} |")
    cycles = ours["idle"]["cycles"]
    idle = [c for cyc in cycles for c in cyc["reader_cpu_share_of_core"]]
    cold = [cyc["cold_roundtrip_us"] for cyc in cycles]
    print(f"idle reader share of a core: {idle}; cold round trips (us): {cold}; "
          f"leftover shm: {ours['shm_leftover']}")
    ok &= max(idle) < 0.01 and max(cold) <= 1000 and not ours["shm_leftover"]
    print("meets issue 12's targets" if ok else "MISSES issue 12's targets")
    return ok


if __name__ == "__main__":
    results = [table(p) for p in sys.argv[1:]]
    sys.exit(0 if all(results) else 1)
