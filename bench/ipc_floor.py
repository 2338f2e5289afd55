"""What any blocking broadcast-and-reply can reach on this machine: the same pattern as
bench/ipc.py (1 writer, 2 reader processes, futex wake-ups), written in C with no payload.

    .venv/bin/python bench/ipc_floor.py

Compiles bench/csrc/broadcast_floor.c with gcc and prints the median / p99 round trip with 0, 5,
10 and 20 us of busy work on each side per step (a Python queue spends 10-20 us a side pickling
and keeping books), without and with brief spinning before each sleep.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "broadcast_floor.c")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "broadcast_floor")
        subprocess.run(["gcc", "-O2", SOURCE, "-o", exe], check=True)
        print(f"cores available: {len(os.sched_getaffinity(0))}; 1 writer, 2 readers, C, futex")
        print(f"{'work us/side':>12} {'spin':>6} {'median us':>10} {'p99 us':>8}")
        for spin in (0, 1000):
            for work in (0, 5, 10, 20):
                out = subprocess.run([exe, str(work), str(spin)], capture_output=True, text=True,
                                     check=True, timeout=300).stdout.split()
                print(f"{work:>12} {spin:>6} {float(out[0]):>10.1f} {float(out[1]):>8.1f}",
                      flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
