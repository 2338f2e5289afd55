"""Failover: an engine core of `shardserve serve` SIGKILLed in the middle of streamed requests;
how long until each of its requests gets its next token (issue 27, "a server that heals").

    python bench/failover.py [--dp 2 1] [--rounds 3] [--streams 4] [--max-tokens 256]
                             [--tokens-before-kill 16] [--model PATH] [--dtype auto]
                             [--restart-window-s 1]

Per DP size, one server (`shardserve serve --port 0 --port-file ... --data-parallel-size D
--max-engine-restarts 100`, threads per engine as the server picks them) stays up for every
round. Before the rounds: a warm-up, then the reference texts: the --streams prompts at once,
greedy, --max-tokens with ignore_eos, uninterrupted, twice ("ref noise": prompts whose two
uninterrupted runs already differ). Each round:
  * DP=1 only, first: the engine's cold start, a fresh server of the same flags: from spawning
    it to the first streamed token of a 1-token request sent as soon as it writes its port file
    (the column "cold start", the one the DP=1 target uses; the column "ready" is the same spawn
    to its log line "engine core 0 (pid N) ready", without the HTTP front end's start and the
    first request);
  * the --streams prompts, streamed at once (httpx, /v1/completions, greedy, ignore_eos,
    logprobs 0 so that each event says how many tokens it carries: an event holds back a token
    whose text is not final); once each has --tokens-before-kill tokens, engine core 0 (the
    process titled `shardserve::engine_core`) is SIGKILLed;
  * the migrated requests are those the server logs as "request X moved ... after K tokens";
    for each, kill -> next token is the time from the SIGKILL to the client receiving its token
    K+1 (the first one a live replica produced: tokens the dead one sent before dying may still
    arrive after the kill). Each stream's text is compared with its reference (column
    "mismatch": migrated streams / all streams);
  * the server's own restart time is its line "engine core 0 restarted in S s"; the round ends
    once /health says "ok" again (every replica serves).
Every round is the first restart of its window (the server's --engine-restart-window, 1 s by
default here): the server backs off 0.5 s, 1 s, 2 s ... before a restart that others preceded
within the window, a repeated-failure policy this bench does not measure by default
(--restart-window-s 600, the server's default, to see it).

Exact text needs batch-invariant numerics: with --dtype auto (bfloat16 on a CPU with
AVX512-BF16) the same request's greedy text can change with the batch it ran in, so "ref
noise" is non-zero and mismatches there are not the migration's; --dtype float32 checks it.

Targets (issue 27): kill -> first token of a migrated request <= 1 s on a surviving replica
(DP=2); with DP=1, <= the engine's cold start + 1 s (here: each round's slowest migrated
request against the same round's cold start). The breakdown splits the slowest migrated
request's time by the server's log stamps (millisecond resolution): kill -> the front end logs
the death; death -> the request sent to a replica ("moved"; DP=1: once the restarted replica is
up); death -> the restart logged done (stop of the dead replica's rest, backoff, the new
process's start and model load); moved -> the client's next token (re-prefill of prompt +
produced tokens, the step, the stream).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import psutil
from _rounds import make_prompts, median_or_nan

TIMEOUT_S = 300.0
TARGET_S = 1.0
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_MOVED = re.compile(r"request (\S+) moved(?: from engine core (\d+))? to engine core (\d+) "
                    r"after (\d+) tokens")
_RESTARTED = re.compile(r"engine core (\d+) restarted in ([\d.]+) s")
_DIED = re.compile(r"engine core (\d+) died: ")
_READY = re.compile(r"engine core (\d+) \(pid \d+\) ready")
_CORE_TITLE = re.compile(r"engine_core(?:_(\d+))?$")


def cpu_line() -> str:
    """The CPU's model name, its core count and the best ISA extension the kernels use."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU: unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                 if ln.startswith("model name")), "unknown")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                      if ln.startswith("flags")), []))
    isa = ("AVX-512" + (" + BF16" if "avx512_bf16" in flags else "")
           + (" + AMX" if "amx_bf16" in flags else "")) if "avx512f" in flags \
        else "AVX2" if "avx2" in flags else "no AVX2"
    return f"CPU: {name}, {len(os.sched_getaffinity(0))} cores, {isa}"


# ---- the server ----
class Server:
    """`shardserve serve` in a subprocess, its log in a file; `spawned` is its time.time()."""

    def __init__(self, args: argparse.Namespace, dp: int, extra: tuple[str, ...] = ()) -> None:
        port_file = tempfile.mktemp(prefix="shardserve-failover-port-")
        cmd = [sys.executable, "-m", "shardserve", "serve", "--host", "127.0.0.1", "--port", "0",
               "--port-file", port_file, "--dtype", args.dtype, "--max-model-len", "1024",
               "--data-parallel-size", str(dp), "--uvicorn-log-level", "warning", *extra]
        if args.model:
            cmd += ["--model", args.model]
        log = tempfile.NamedTemporaryFile(prefix="shardserve-failover-", suffix=".log",
                                          delete=False)
        self.log_path = log.name
        self.spawned = time.time()
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 180
        while not os.path.exists(port_file):  # written once the server serves
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("the server did not start within 180 s")
            time.sleep(0.005)
        with open(port_file) as f:
            self.url = f"http://127.0.0.1:{int(f.read())}"
        os.unlink(port_file)

    def log(self, offset: int = 0) -> str:
        with open(self.log_path, errors="replace") as f:
            f.seek(offset)
            return f.read()

    def log_size(self) -> int:
        return os.path.getsize(self.log_path)

    def engine_core(self, index: int) -> psutil.Process:
        """The engine-core process of replica `index` (titled shardserve::engine_core[_i])."""
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                m = _CORE_TITLE.search(" ".join(p.cmdline()).strip())
                if m and int(m.group(1) or 0) == index:
                    return p
        raise RuntimeError(f"no engine core {index} under the server (pid {self.proc.pid})")

    def health(self) -> str:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).json().get("status", "?")
        except (httpx.HTTPError, ValueError):
            return "?"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def stamped(text: str, pattern: re.Pattern) -> list[tuple[float, re.Match]]:
    """(time.time() of the line, match) for each log line matching pattern."""
    out = []
    for line in text.splitlines():
        m, s = pattern.search(line), _STAMP.match(line)
        if m and s:
            out.append((datetime.strptime(s.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), m))
    return out


# ---- streams ----
@dataclass
class Stream:
    """One streamed completion in a thread: each event's arrival (time.time()) and text."""

    url: str
    body: dict
    times: list[float] = field(default_factory=list)  # per event
    texts: list[str] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # tokens received so far, per event
    rid: str = ""
    finish: str | None = None
    errors: list = field(default_factory=list)
    failure: Exception | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions",
                              json={**self.body, "stream": True}, timeout=TIMEOUT_S) as resp:
                for line in resp.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    now = time.time()
                    self.rid = event.get("id", self.rid)
                    if "error" in event:
                        self.errors.append(event["error"])
                    for choice in event.get("choices", []):
                        # An event holds back tokens whose text is not final (a partial UTF-8
                        # character): it counts the tokens its logprobs list.
                        tokens = len((choice.get("logprobs") or {}).get("tokens") or [None])
                        self.times.append(now)
                        self.texts.append(choice.get("text", ""))
                        self.counts.append((self.counts[-1] if self.counts else 0) + tokens)
                        self.finish = choice.get("finish_reason") or self.finish
        except Exception as e:  # noqa: BLE001 - reported
            self.failure = e

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def tokens(self) -> int:
        return self.counts[-1] if self.counts else 0

    def arrival(self, token: int) -> float | None:
        """When the client received its token number `token` (1-based)."""
        return next((t for t, n in zip(self.times, self.counts, strict=True) if n >= token),
                    None)

    def wait(self, tokens: int, deadline: float) -> None:
        while self.tokens < tokens and self.thread.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError(f"stream {self.rid} has {self.tokens} tokens")
            time.sleep(0.002)
        if self.tokens < tokens:
            raise RuntimeError(f"stream ended after {self.tokens} tokens "
                               f"({self.failure or self.errors}); raise --max-tokens")


def body(prompt: str, max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}


def references(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """The uninterrupted texts: every prompt at once, as in a round."""
    streams = [Stream(url, body(p, max_tokens)) for p in prompts]
    for s in streams:
        s.thread.join(TIMEOUT_S)
        if s.failure or s.errors or s.finish != "length":
            raise RuntimeError(f"reference failed: {s.failure or s.errors or s.finish}")
    return [s.text for s in streams]


def cold_start(args: argparse.Namespace) -> tuple[float, float]:
    """A fresh DP=1 server: (spawn -> first streamed token, spawn -> 'engine core 0 ready')."""
    server = Server(args, 1, ("--max-engine-restarts", "100"))
    try:
        s = Stream(server.url, body("Hi", 1))
        s.thread.join(TIMEOUT_S)
        if not s.times:
            raise RuntimeError(f"cold-start request failed: {s.failure or s.errors}")
        ready = stamped(server.log(), _READY)
        return s.times[0] - server.spawned, \
            (ready[0][0] - server.spawned if ready else float("nan"))
    finally:
        server.stop()


# ---- one round ----
@dataclass
class RoundResult:
    gaps: list[float]  # kill -> next token, per migrated request
    restart_s: float  # the server's "restarted in"
    migrated: int
    mismatches: int  # streams whose text differs from the reference
    migrated_mismatches: int  # of them, migrated ones
    failed: int
    parts: dict[str, float]  # breakdown, seconds (the slowest migrated request's)
    cold: tuple[float, float] | None = None
    tokens_ok: bool = True  # every stream had --max-tokens tokens


def kill_round(server: Server, prompts: list[str], refs: list[str],
               args: argparse.Namespace) -> RoundResult:
    offset = server.log_size()
    streams = [Stream(server.url, body(p, args.max_tokens)) for p in prompts]
    deadline = time.monotonic() + TIMEOUT_S
    for s in streams:
        s.wait(args.tokens_before_kill, deadline)
    core = server.engine_core(0)
    t_kill = time.time()
    core.send_signal(signal.SIGKILL)
    for s in streams:
        s.thread.join(TIMEOUT_S)
    while not _RESTARTED.search(server.log(offset)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no restart logged: {server.log(offset)[-2000:]}")
        time.sleep(0.05)
    while server.health() != "ok":
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not become healthy again")
        time.sleep(0.05)
    log = server.log(offset)
    moved = {m.group(1): (t, int(m.group(4))) for t, m in stamped(log, _MOVED)}
    died = [t for t, m in stamped(log, _DIED) if m.group(1) == "0"]
    restarted = [(t, float(m.group(2))) for t, m in stamped(log, _RESTARTED)
                 if m.group(1) == "0"]
    ready = [t for t, m in stamped(log, _READY) if m.group(1) == "0"]
    gaps, mismatches, migrated_mismatches, failed = [], 0, 0, 0
    slowest, tokens_ok = None, True
    for s, ref in zip(streams, refs, strict=True):
        if s.failure or s.errors or s.finish != "length":
            failed += 1
        differs = s.text != ref
        mismatches += differs
        tokens_ok &= s.tokens == args.max_tokens
        hit = next(((t, k) for rid, (t, k) in moved.items()
                    if rid == s.rid or rid.startswith(s.rid + "-")), None)
        if hit is None:
            continue
        t_moved, k = hit
        if (t_next := s.arrival(k + 1)) is None:
            continue
        gap = t_next - t_kill
        gaps.append(gap)
        migrated_mismatches += differs
        if slowest is None or gap > slowest[0]:
            slowest = (gap, t_moved)
    parts = {}
    if slowest and died and restarted:
        t_died, (t_up, _) = died[0], restarted[0]
        parts = {"kill -> death logged": t_died - t_kill,
                 "death -> new core ready": (ready[0] if ready else float("nan")) - t_died,
                 "death -> restart done": t_up - t_died,
                 "death -> moved": slowest[1] - t_died,
                 "moved -> next token": t_kill + slowest[0] - slowest[1]}
    return RoundResult(gaps, restarted[0][1] if restarted else float("nan"), len(gaps),
                       mismatches, migrated_mismatches, failed, parts, tokens_ok=tokens_ok)


# ---- the run ----
def run_dp(args: argparse.Namespace, dp: int, prompts: list[str]
           ) -> tuple[list[RoundResult], int]:
    """The rounds, and how many references differed between two uninterrupted runs."""
    server = Server(args, dp, ("--max-engine-restarts", "100", "--engine-restart-window",
                               str(args.restart_window_s)))
    print(f"DP={dp}: server log {server.log_path}", flush=True)
    try:
        references(server.url, prompts, 8)  # warm-up
        refs = references(server.url, prompts, args.max_tokens)
        again = references(server.url, prompts, args.max_tokens)
        unstable = sum(a != b for a, b in zip(refs, again, strict=True))
        results = []
        for r in range(args.rounds):
            cold = cold_start(args) if dp == 1 else None
            result = kill_round(server, prompts, refs, args)
            result.cold = cold
            results.append(result)
            extra = f", cold start {cold[0]:.2f} s" if cold else ""
            print(f"DP={dp} round {r + 1}/{args.rounds}: {result.migrated} migrated, kill -> "
                  f"next token max {max(result.gaps, default=float('nan')):.2f} s, restart "
                  f"{result.restart_s:.2f} s{extra}, text mismatches (migrated / all) "
                  f"{result.migrated_mismatches} / {result.mismatches}, "
                  f"load average {os.getloadavg()[0]:.1f}, "
                  f"failed {result.failed}", flush=True)
        return results, unstable
    finally:
        server.stop()


def fmt(x: float) -> str:
    return "-" if x != x else f"{x:.2f}"


def report(args: argparse.Namespace, by_dp: dict[int, list[RoundResult]],
           unstable: dict[int, int]) -> None:
    print(f"\n{cpu_line()}")
    print(f"model={args.model or 'default (SmolLM2-135M)'} dtype={args.dtype} "
          f"streams={args.streams} max_tokens={args.max_tokens} kill after "
          f"{args.tokens_before_kill} tokens, {args.rounds} rounds; seconds; median / max over "
          f"every migrated request of every round")
    print(f"| {'DP':>2} | {'migrated':>8} | {'kill->next tok':>14} | {'restart':>11} | "
          f"{'cold start':>11} | {'ready':>11} | {'gap - cold':>13} | {'target':>14} | "
          f"{'holds':>5} | {'mismatch m/all':>14} | {'ref noise':>9} | {'failed':>6} |")
    print("|" + "|".join("-" * (w + 2) for w in (2, 8, 14, 11, 11, 11, 13, 14, 5, 14, 9, 6))
          + "|")
    for dp, results in by_dp.items():
        gaps = [g for r in results for g in r.gaps]
        restarts = [r.restart_s for r in results]
        colds = [r.cold[0] for r in results if r.cold]
        readies = [r.cold[1] for r in results if r.cold]
        over = [max(r.gaps) - r.cold[0] for r in results if r.cold and r.gaps]

        def mm(v: list[float]) -> str:
            return f"{fmt(median_or_nan(v))} / {fmt(max(v))}" if v else "-"

        mism = (f"{sum(r.migrated_mismatches for r in results)} / "
                f"{sum(r.mismatches for r in results)}")
        if dp == 1:
            target, holds = "cold + 1 s", bool(over) and max(over) <= TARGET_S
        else:
            target, holds = "<= 1 s", bool(gaps) and max(gaps) <= TARGET_S
        print(f"| {dp:>2} | {len(gaps):>8} | {mm(gaps):>14} | {mm(restarts):>11} | "
              f"{mm(colds):>11} | {mm(readies):>11} | {mm(over):>13} | {target:>14} | "
              f"{'yes' if holds else 'NO':>5} | {mism:>14} | "
              f"{unstable[dp]:>9} | {sum(r.failed for r in results):>6} |")
    print("\nwhere the time goes (the slowest migrated request of each round; median / max "
          "over the rounds, seconds, from the server's log stamps):")
    for dp, results in by_dp.items():
        keys = [k for k in results[0].parts] if results and results[0].parts else []
        row = ", ".join(f"{k} {fmt(statistics.median(v))} / {fmt(max(v))}"
                        for k in keys if (v := [r.parts[k] for r in results if r.parts]))
        print(f"  DP={dp}: {row or '-'}")
    if not all(r.tokens_ok for rs in by_dp.values() for r in rs):
        print("note: some stream did not get --max-tokens tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--tokens-before-kill", type=int, default=16)
    parser.add_argument("--restart-window-s", type=float, default=1.0,
                        help="the server's --engine-restart-window (a restart's backoff grows "
                        "with the restarts before it within it)")
    args = parser.parse_args()
    prompts = make_prompts(args.streams)
    runs = {dp: run_dp(args, dp, prompts) for dp in args.dp}
    report(args, {dp: r for dp, (r, _) in runs.items()}, {dp: u for dp, (_, u) in runs.items()})


if __name__ == "__main__":
    main()
