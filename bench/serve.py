"""Server benchmark: N concurrent streaming clients against `shardserve serve`, beside offline
`LLM.generate` on the same prompts, in one run (offline first, then the server; never together).

    python bench/serve.py [--num-clients 32] [--num-requests 64] [--max-tokens 64]
                          [--dtype auto] [--repeats 2] [--time-limit-s 150]

Offline runs twice: all prompts at once, and at most --num-clients at a time (the server's
width), so the report separates the batch-size effect from the front end's cost.
Loopback only; bounded in requests and time (the server phase is cancelled at --time-limit-s).
Greedy, ignore_eos, so every request produces exactly --max-tokens tokens. Each phase runs
--repeats rounds and reports its fastest (the machine may be shared). Prints request
throughput, output tokens/s, p50/p99 time to first token and inter-token latency (gaps between
streamed chunks), and the server's throughput as a fraction of offline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

TOPICS = ["the ocean", "a city at night", "machine learning", "an old library", "mountains",
          "a chess game", "the history of bread", "volcanoes"]
STYLES = ["Write a story about", "Explain to a child", "List facts about", "Describe"]


def make_prompts(n: int) -> list[str]:
    return [f"{STYLES[i % len(STYLES)]} {TOPICS[(i // 4) % len(TOPICS)]} (#{i}):" for i in range(n)]


def engine_options(args: argparse.Namespace) -> dict:
    return {"dtype": args.dtype, "max_model_len": 1024, "max_num_seqs": 128}


# ---- offline ----
def bench_offline(
    args: argparse.Namespace, prompts: list[str], max_num_seqs: int | None = None
) -> dict[str, float]:
    from shardserve import LLM, SamplingParams

    options = engine_options(args)
    if max_num_seqs is not None:
        options["max_num_seqs"] = max_num_seqs
    llm = LLM(args.model, **options)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        elapsed = float("inf")
        for _ in range(args.repeats):  # best of: the machine may be shared
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = min(elapsed, time.perf_counter() - t0)
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"elapsed": elapsed, "tokens": tokens, "requests": len(outs)}


# ---- server ----
@dataclass
class Result:
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    ok: bool = False


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    opts = engine_options(args)
    cmd = [sys.executable, "-m", "shardserve", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--dtype", opts["dtype"], "--max-model-len", str(opts["max_model_len"]),
           "--max-num-seqs", str(opts["max_num_seqs"]), "--uvicorn-log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    # The server's log goes to a file: an unread pipe could fill up and stall it.
    log = tempfile.NamedTemporaryFile(prefix="shardserve-bench-", suffix=".log", delete=False)
    print(f"server log: {log.name}", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {open(log.name).read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(proc)
    raise TimeoutError("server did not become healthy within 180 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


async def one_request(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> Result:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = Result()
    t0 = time.perf_counter()
    last = None
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            now = time.perf_counter()
            if event.get("usage"):
                result.tokens = event["usage"]["completion_tokens"]
            if not event.get("choices"):
                continue
            if last is None:
                result.ttft = now - t0
            else:
                result.gaps.append(now - last)
            last = now
    result.ok = resp.status_code == 200 and result.tokens == max_tokens
    return result


async def drive(url: str, prompts: list[str], clients: int, max_tokens: int, repeats: int
                ) -> tuple[list[Result], float]:
    """The best of `repeats` rounds (shortest wall time), after a warm-up request."""
    best: tuple[list[Result], float] | None = None
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        await one_request(http, prompts[0], 4)
        for _ in range(repeats):
            results, elapsed = await one_round(http, prompts, clients, max_tokens)
            if best is None or elapsed < best[1]:
                best = (results, elapsed)
    assert best is not None
    return best


async def one_round(http: httpx.AsyncClient, prompts: list[str], clients: int, max_tokens: int
                    ) -> tuple[list[Result], float]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[Result] = []

    async def client() -> None:
        while not queue.empty():
            results.append(await one_request(http, queue.get_nowait(), max_tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return results, time.perf_counter() - t0


def bench_server(args: argparse.Namespace, prompts: list[str]) -> tuple[list[Result], float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_server(args, port)
    try:
        return asyncio.run(asyncio.wait_for(
            drive(f"http://127.0.0.1:{port}", prompts, args.num_clients, args.max_tokens,
                  args.repeats),
            args.time_limit_s))
    finally:
        stop_server(proc)


# ---- report ----
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def report(
    args: argparse.Namespace, offline: dict, capped: dict, results: list[Result], elapsed: float
) -> None:
    tokens = sum(r.tokens for r in results)
    failed = sum(not r.ok for r in results)
    off_rate = offline["tokens"] / offline["elapsed"]
    capped_rate = capped["tokens"] / capped["elapsed"]
    srv_rate = tokens / elapsed
    ttft = [r.ttft for r in results]
    gaps = [g for r in results for g in r.gaps]
    print(f"\nmodel={args.model or 'default'} dtype={args.dtype} clients={args.num_clients} "
          f"requests={len(results)} (failed {failed}) max_tokens={args.max_tokens}")
    print(f"| {'metric':<28} | {'value':>10} |\n|{'-' * 30}|{'-' * 12}|")
    rows = [("offline output tokens/s", off_rate),
            ("server output tokens/s", srv_rate),
            ("server / offline", srv_rate / off_rate),
            (f"offline, {args.num_clients} at a time", capped_rate),
            (f"server / offline {args.num_clients} at a time", srv_rate / capped_rate),
            ("server requests/s", len(results) / elapsed),
            ("TTFT p50 (ms)", 1000 * pct(ttft, 50)),
            ("TTFT p99 (ms)", 1000 * pct(ttft, 99)),
            ("ITL p50 (ms)", 1000 * pct(gaps, 50)),
            ("ITL p99 (ms)", 1000 * pct(gaps, 99))]
    for name, value in rows:
        print(f"| {name:<28} | {value:>10.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-clients", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="rounds per phase; best counts")
    parser.add_argument("--time-limit-s", type=float, default=150.0)
    args = parser.parse_args()
    prompts = make_prompts(args.num_requests)
    print("offline phase ...", flush=True)
    offline = bench_offline(args, prompts)
    print(f"offline: {offline['tokens']} tokens in {offline['elapsed']:.2f} s", flush=True)
    # The server never has more than --num-clients requests in flight; offline at that width
    # isolates the front end's cost from the batch-size effect.
    capped = bench_offline(args, prompts, max_num_seqs=args.num_clients)
    print(f"offline, {args.num_clients} at a time: {capped['tokens']} tokens in "
          f"{capped['elapsed']:.2f} s", flush=True)
    print("server phase ...", flush=True)
    results, elapsed = bench_server(args, prompts)
    report(args, offline, capped, results, elapsed)


if __name__ == "__main__":
    main()
