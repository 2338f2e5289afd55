"""Cold start: process start -> first token of `shardserve generate "Hi" --max-tokens 1`.

    python bench/cold_start.py [--rounds 5] [--model PATH] [--no-breakdown]

Rows (seconds, min / median / max over the rounds, each a fresh process):
  * cli first token: from spawning the `shardserve` console script to the line announcing the
    first output on its stdout (with --max-tokens 1 that is the first token);
  * cli exit: to the process's exit (engine shutdown and interpreter teardown included);
  * breakdown, a fresh `python -c` doing what the CLI does, stamped from its spawn:
    `import shardserve`, `LLM()` constructed, the first generate returned.

Each round runs the CLI then the breakdown, back to back, so the rows share the machine's drift.
The first round pays the page cache (model file, .so files); take the min as the cold start of a
warm disk and the median as what a user usually sees. Issue 14's target: cli first token <= 2 s.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

FIRST_OUTPUT = "--- output 1"

# Printed by the breakdown child: "<label> <time.time()>" per stage.
_BREAKDOWN = """
import sys, time
import shardserve
print("import", time.time(), flush=True)
llm = shardserve.LLM(sys.argv[1] or None)
print("LLM()", time.time(), flush=True)
llm.generate("Hi", shardserve.SamplingParams(max_tokens=1), use_tqdm=False)
print("first generate", time.time(), flush=True)
llm.shutdown()
"""


def cli_command(model: str | None) -> list[str]:
    script = Path(sys.executable).with_name("shardserve")
    base = [str(script)] if script.exists() else [sys.executable, "-m", "shardserve"]
    model_flag = ["--model", model] if model else []
    return [*base, "generate", "Hi", "--max-tokens", "1", *model_flag]


def time_cli(model: str | None) -> tuple[float, float]:
    """(seconds to the first output line, seconds to exit) of one CLI run."""
    start = time.perf_counter()
    proc = subprocess.Popen(cli_command(model), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    first = float("nan")
    for line in proc.stdout:
        if line.startswith(FIRST_OUTPUT) and first != first:
            first = time.perf_counter() - start
    if proc.wait() != 0:
        raise RuntimeError(f"{' '.join(cli_command(model))} exited with {proc.returncode}")
    return first, time.perf_counter() - start


def time_breakdown(model: str | None) -> dict[str, float]:
    """Seconds from spawn to each stage of the breakdown child."""
    start = time.time()
    out = subprocess.run([sys.executable, "-c", _BREAKDOWN, model or ""], capture_output=True,
                         text=True, check=True).stdout
    stamps = {}
    for line in out.splitlines():
        label, _, stamp = line.rpartition(" ")
        stamps[label] = float(stamp) - start
    return stamps


def row(label: str, values: list[float]) -> str:
    return (f"{label:<28} {min(values):>7.2f} {statistics.median(values):>7.2f} "
            f"{max(values):>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--no-breakdown", action="store_true")
    args = parser.parse_args()
    samples: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        first, done = time_cli(args.model)
        samples.setdefault("cli first token", []).append(first)
        samples.setdefault("cli exit", []).append(done)
        if not args.no_breakdown:
            for label, t in time_breakdown(args.model).items():
                samples.setdefault(f"  {label}", []).append(t)
    print(f"cold start over {args.rounds} rounds: {' '.join(cli_command(args.model))}")
    print(f"{'seconds from spawn':<28} {'min':>7} {'median':>7} {'max':>7}")
    for label, values in samples.items():
        print(row(label, values))


if __name__ == "__main__":
    main()
