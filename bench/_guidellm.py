"""The guidellm part of bench/serve.py: a real load generator against the server, beside offline
`LLM.generate` at the same width.

guidellm (pinned in the `bench` extra) runs as a subprocess, one run per stream count, against
the server the bench starts; it works offline: synthetic prompts, and the tokenizer saved from
the model's own files (`--tokenizer kind=hf_auto,model=<folder>`, no hub download). Each level
sends one untimed warm-up wave (guidellm's warm-up phase, `streams` requests) and then
--guidellm-waves x streams measured requests, bounded by --guidellm-seconds. Offline runs the
same number of prompts in flight (width = streams, one generate of `streams` prompts per wave)
with the same prompt/output token counts, greedy and ignore_eos. The two sides take turns
within each level (which goes first alternates), never both at once.

The load generator's own CPU is measured with psutil on its process tree (CPU-seconds / wall
seconds): on a 2-core machine it takes a sizeable share, so its figures are not the server's
ceiling.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

INSTALL_HINT = ("pip install 'shardserve[bench]' (or guidellm==0.8.1 in a separate venv) and "
                "pass --guidellm PATH")


def find_guidellm(explicit: str | None) -> str | None:
    """--guidellm PATH, else `guidellm` on PATH, else the one next to this interpreter (the
    `bench` extra installed into the project's venv)."""
    if explicit:
        path = shutil.which(explicit) or (explicit if os.access(explicit, os.X_OK) else None)
        return path
    found = shutil.which("guidellm")
    if found:
        return found
    beside = Path(sys.executable).parent / "guidellm"
    return str(beside) if os.access(beside, os.X_OK) else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("guidellm part")
    group.add_argument("--guidellm", default=None, metavar="PATH",
                       help="the guidellm executable (default: `guidellm` on PATH, then the "
                       "`bench` extra's install beside this Python)")
    group.add_argument("--no-guidellm", action="store_true", help="skip the guidellm part")
    group.add_argument("--no-light-client", action="store_true",
                       help="skip the light-client part (server-vs-offline ratio)")
    group.add_argument("--guidellm-streams", default="1,4,16,32",
                       help="concurrent stream counts, one guidellm run each")
    group.add_argument("--guidellm-seconds", type=float, default=60.0,
                       help="max duration of one stream count's guidellm run (warm-up included)")
    group.add_argument("--guidellm-waves", type=int, default=2,
                       help="measured requests per stream count = waves x streams (after one "
                       "warm-up wave); offline runs the same number of waves")
    group.add_argument("--guidellm-prompt-tokens", type=int, default=256)
    group.add_argument("--guidellm-output-tokens", type=int, default=128)


# ---- CPU of a process tree ----
class TreeCPU:
    """Polls a process and its descendants; CPU-seconds (user + system) over time."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.root = psutil.Process(pid)
        self.interval = interval
        self.last: dict[tuple[int, float], float] = {}
        self.samples: list[tuple[float, float]] = []  # (time.time(), tree CPU-seconds so far)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        for p in procs:
            try:
                t = p.cpu_times()
                self.last[(p.pid, p.create_time())] = t.user + t.system
            except psutil.Error:
                pass
        self.samples.append((time.time(), sum(self.last.values())))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._poll()
            self._stop.wait(self.interval)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return sum(self.last.values())

    def between(self, t0: float, t1: float) -> float:
        """Tree CPU-seconds used between two time.time() instants (linear between samples)."""
        return self._at(t1) - self._at(t0)

    def _at(self, t: float) -> float:
        times = [s[0] for s in self.samples]
        i = bisect.bisect_left(times, t)
        if i == 0:
            return self.samples[0][1] if self.samples else 0.0
        if i >= len(self.samples):
            return self.samples[-1][1]
        (ta, ca), (tb, cb) = self.samples[i - 1], self.samples[i]
        return ca + (cb - ca) * (t - ta) / max(tb - ta, 1e-9)


# ---- one guidellm run ----
@dataclass
class LevelResult:
    streams: int
    ok: bool = False
    error: str = ""
    tokens_per_s: float = float("nan")
    ttft: dict[str, float] = field(default_factory=dict)  # p50/p90/p99, ms
    itl: dict[str, float] = field(default_factory=dict)
    tpot_mean: float = float("nan")
    requests: int = 0
    failed: int = 0
    cpu_cores_run: float = float("nan")  # guidellm tree CPU-s / its wall-s, whole run
    cpu_cores_window: float = float("nan")  # the same, over the measured window only
    offline_tokens_per_s: float = float("nan")
    offline_ms_per_token: float = float("nan")


def percentiles(metric: dict) -> dict[str, float]:
    pcts = metric["successful"]["percentiles"]
    return {q: float(pcts[q]) for q in ("p50", "p90", "p99")}


def guidellm_command(exe: str, url: str, tokenizer: str, streams: int, args: argparse.Namespace,
                     out_json: str) -> list[str]:
    # Every option as JSON: guidellm 0.8.1 parses YAML/JSON as well as key=value lists, and JSON
    # leaves no doubt where a nested value (warm-up) ends.
    warmup = {"value": streams, "mode": "requests"}
    total = (args.guidellm_waves + 1) * streams
    options = {
        "--backend": {"kind": "openai_http", "target": url, "request_format": "/v1/completions",
                      "timeout": max(60.0, args.guidellm_seconds * 2)},
        "--tokenizer": {"kind": "hf_auto", "model": tokenizer},
        "--data": {"kind": "synthetic_text", "prompt_tokens": args.guidellm_prompt_tokens,
                   "output_tokens": args.guidellm_output_tokens},
        "--profile": {"kind": "concurrent", "streams": [streams], "warmup": warmup},
        "--output": {"kind": "json", "path": out_json},
    }
    cmd = [exe, "run"]
    for flag, value in options.items():
        cmd += [flag, json.dumps(value)]
    cmd += ["--constraint", json.dumps({"kind": "max_requests", "count": total}),
            "--constraint", json.dumps({"kind": "max_duration",
                                        "seconds": args.guidellm_seconds}),
            "--disable-console-interactive"]
    return cmd


def run_guidellm(exe: str, url: str, tokenizer: str, streams: int,
                 args: argparse.Namespace) -> LevelResult:
    result = LevelResult(streams)
    workdir = tempfile.mkdtemp(prefix="shardserve-guidellm-")
    out_json = os.path.join(workdir, "report.json")
    log_path = os.path.join(workdir, "guidellm.log")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = guidellm_command(exe, url, tokenizer, streams, args, out_json)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log_path, "w") as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)
        cpu = TreeCPU(proc.pid)
        try:
            rc = proc.wait(timeout=args.guidellm_seconds + 180)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        wall = time.time() - t0
        polled = cpu.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Waited-for descendants are all in RUSAGE_CHILDREN; polling can miss a child's last moments.
    waited = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result.cpu_cores_run = max(polled, waited) / wall
    if rc != 0 or not os.path.exists(out_json):
        with open(log_path, errors="replace") as f:
            tail = f.read()[-1500:]
        result.error = f"guidellm exited with {rc} (log: {log_path}):\n{tail}"
        return result
    with open(out_json) as f:
        bench = json.load(f)["benchmarks"][0]
    metrics, sched = bench["metrics"], bench["scheduler_metrics"]
    totals = metrics["request_totals"]
    result.requests = int(totals["successful"])
    result.failed = int(totals["errored"]) + int(totals["incomplete"])
    start, end = float(sched["measure_start_time"]), float(sched["measure_end_time"])
    window = end - start
    out_tokens = float(metrics["output_token_count"]["successful"]["total_sum"])
    if window > 0 and result.requests:
        result.tokens_per_s = out_tokens / window
        result.cpu_cores_window = cpu.between(start, end) / window
    result.ttft = percentiles(metrics["time_to_first_token_ms"])
    result.itl = percentiles(metrics["inter_token_latency_ms"])
    result.tpot_mean = float(metrics["time_per_output_token_ms"]["successful"]["mean"])
    result.ok = result.requests > 0
    if result.failed:
        result.error = (f"{totals['errored']} errored, {totals['incomplete']} incomplete "
                        f"(cut at --guidellm-seconds?); first error: "
                        f"{first_error(bench['requests'])} (report: {out_json})")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def first_error(requests: dict) -> str:
    for kind in ("errored", "incomplete"):
        for req in requests.get(kind) or []:
            found = _find_key(req, "error")
            if found:
                return str(found)[:300]
    return "none recorded"


def _find_key(obj, key: str):
    if isinstance(obj, dict):
        if obj.get(key):
            return obj[key]
        for value in obj.values():
            found = _find_key(value, key)
            if found:
                return found
    elif isinstance(obj, list):
        for value in obj:
            found = _find_key(value, key)
            if found:
                return found
    return None


# ---- offline at the same width ----
def token_prompts(tokenizer, n: int, length: int, seed: int) -> list[dict]:
    """n distinct prompts of exactly `length` token ids, cut from ordinary text."""
    words = ("the ocean city night machine learning library mountains chess game history bread "
             "volcanoes story child facts river forest music light stone window garden").split()
    text = " ".join(words[(i * 7 + seed) % len(words)] for i in range(length * 4 + 64 * n))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = []
    for i in range(n):
        head = tokenizer(f"#{seed}-{i}:", add_special_tokens=False)["input_ids"]
        body = ids[i * 17: i * 17 + length]
        prompts.append({"prompt_token_ids": (head + body)[:length]})
    return prompts


def run_offline(llm, tokenizer, streams: int, args: argparse.Namespace, level_index: int
                ) -> tuple[float, float]:
    """Tokens/s and mean ms per output token of one sequence (decode step time, prefill
    included), over --guidellm-waves generates of `streams` prompts each."""
    from shardserve import SamplingParams

    params = SamplingParams(max_tokens=args.guidellm_output_tokens, temperature=0,
                            ignore_eos=True)
    tokens, elapsed = 0, 0.0
    for wave in range(args.guidellm_waves):
        prompts = token_prompts(tokenizer, streams, args.guidellm_prompt_tokens,
                                seed=100 * level_index + wave)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed += time.perf_counter() - t0
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    per_token = 1000 * elapsed / (args.guidellm_waves * args.guidellm_output_tokens)
    return tokens / elapsed, per_token


# ---- the part ----
def run_part(args: argparse.Namespace, start_server, stop_server, offline_factory,
             warm_server) -> None:
    exe = find_guidellm(args.guidellm)
    if exe is None:
        what = f"--guidellm {args.guidellm} is not an executable" if args.guidellm else \
            "guidellm not found"
        print(f"\nguidellm part skipped: {what}; install it with {INSTALL_HINT}", flush=True)
        return
    levels = [int(s) for s in args.guidellm_streams.split(",") if s.strip()]
    from shardserve.model.loader import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(args.model))
    tok_dir = tempfile.mkdtemp(prefix="shardserve-bench-tokenizer-")
    tokenizer.save_pretrained(tok_dir)
    print(f"\nguidellm part: {exe}, streams {levels}, "
          f"{args.guidellm_prompt_tokens}/{args.guidellm_output_tokens} prompt/output tokens, "
          f"1 warm-up + {args.guidellm_waves} measured waves per level, "
          f"<= {args.guidellm_seconds:.0f} s each", flush=True)
    proc = url = offline = None
    results = []
    try:
        proc, url = start_server(args)
        offline = offline_factory(args)
        warm_server(url, max(levels))
        offline.llm.generate(token_prompts(tokenizer, max(levels), args.guidellm_prompt_tokens,
                                           seed=99),
                             _warm_params(), use_tqdm=False)
        for i, streams in enumerate(levels):
            sides = ["guidellm", "offline"] if i % 2 == 0 else ["offline", "guidellm"]
            took = {}
            for side in sides:
                t0 = time.perf_counter()
                if side == "guidellm":
                    level = run_guidellm(exe, url, tok_dir, streams, args)
                else:
                    off = run_offline(offline.llm, tokenizer, streams, args, i)
                took[side] = time.perf_counter() - t0
            level.offline_tokens_per_s, level.offline_ms_per_token = off
            results.append(level)
            status = "ok" if level.ok else "FAILED"
            print(f"streams {streams}: guidellm {took['guidellm']:.1f} s ({status}), "
                  f"offline {took['offline']:.1f} s", flush=True)
            if level.error:
                print(level.error, flush=True)
    finally:
        if offline is not None:
            offline.shutdown()
        if proc is not None:
            stop_server(proc)
        shutil.rmtree(tok_dir, ignore_errors=True)
    report(args, results)


def _warm_params():
    from shardserve import SamplingParams

    return SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def report(args: argparse.Namespace, results: list[LevelResult]) -> None:
    def fmt(d: dict[str, float]) -> str:
        return "/".join(f"{d[q]:.0f}" for q in ("p50", "p90", "p99")) if d else "-"

    print(f"\nguidellm vs offline LLM.generate, model={args.model or 'default'} "
          f"dtype={args.dtype}, {args.guidellm_prompt_tokens} prompt / "
          f"{args.guidellm_output_tokens} output tokens; latencies in ms (p50/p90/p99); "
          "ms/tok: mean time per output token of one sequence")
    head = (f"| {'streams':>7} | {'server tok/s':>12} | {'offline tok/s':>13} | {'ratio':>5} | "
            f"{'TTFT p50/p90/p99':>18} | {'ITL p50/p90/p99':>15} | {'ms/tok srv':>10} | "
            f"{'ms/tok off':>10} | {'reqs (fail)':>11} | {'guidellm CPU':>12} |")
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for r in results:
        ratio = r.tokens_per_s / r.offline_tokens_per_s
        cpu = f"{r.cpu_cores_window:.2f}/{r.cpu_cores_run:.2f}"
        print(f"| {r.streams:>7} | {r.tokens_per_s:>12.1f} | {r.offline_tokens_per_s:>13.1f} | "
              f"{ratio:>5.2f} | {fmt(r.ttft):>18} | {fmt(r.itl):>15} | {r.tpot_mean:>10.1f} | "
              f"{r.offline_ms_per_token:>10.1f} | {f'{r.requests} ({r.failed})':>11} | "
              f"{cpu:>12} |")
    cores = psutil.cpu_count() or 0
    print(f"guidellm CPU: cores used by guidellm's process tree (CPU-seconds / wall seconds) "
          f"while measuring / over its whole run, out of {cores} on this machine. The load "
          "generator shares the machine with the server, so these server figures are what is "
          "left to the server, not its ceiling; the light client's ratio above is the cheaper "
          "comparison.")
