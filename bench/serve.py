"""Server benchmark: N concurrent streaming clients against `shardserve serve`, beside offline
`LLM.generate` on the same prompts, in one run (the phases take turns; never two at once).

    python bench/serve.py [--num-clients 32] [--num-requests 64] [--max-tokens 64]
                          [--dtype auto] [--rounds 3] [--time-limit-s 150]

Three phases: offline with all prompts at once, offline at most --num-clients at a time (the
server's width, max_num_seqs=--num-clients), and the server under --num-clients streaming clients,
so the report separates the batch-size effect from the front end's cost. Loopback only; bounded
in requests and time (a server round is cancelled at --time-limit-s). Greedy, ignore_eos, so
every request produces exactly --max-tokens tokens.

How the ratios are computed: all three phases stay up and every one gets the same warm-up (one
untimed run of the same prompts with 4 new tokens) before the rounds. Then, --rounds times
(--repeats is the old name), the phases run back to back, the first one rotating from round to
round; server / offline is taken within each round, and the table shows the median of the
per-round ratios and their range. Tokens/s and requests/s are medians over the rounds; TTFT and
inter-token latency (gaps between streamed chunks) percentiles pool every round's requests.

Then the guidellm part (bench/_guidellm.py; skipped with one line when guidellm is not found):
guidellm, a real load generator (`pip install 'shardserve[bench]'`, or any guidellm==0.8.1 via
--guidellm PATH), drives a fresh server at --guidellm-streams concurrent streams, beside offline
LLM.generate at the same width; TTFT / inter-token latency percentiles, output tokens/s and the
CPU guidellm itself used. --no-guidellm / --no-light-client run only one part.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import _guidellm
import httpx
from _rounds import Rounds, make_prompts, median_or_nan, rotated, spread
from _sse_client import Connection, Result

WARMUP_TOKENS = 4


def engine_options(args: argparse.Namespace) -> dict:
    return {"dtype": args.dtype, "max_model_len": 1024, "max_num_seqs": 128}


@dataclass
class Sample:
    """One phase's run in one round, with the CPU it used (CPU-seconds / elapsed = cores):
    offline, the bench process; server, the server's process tree and, apart, the light
    client (the bench's main thread, which runs nothing else meanwhile)."""

    elapsed: float
    tokens: int
    results: list[Result]  # one per request (offline: tokens only)
    cpu_s: float = 0.0  # offline: the bench process; server: the API server process
    client_cpu_s: float = 0.0
    engine_cpu_s: float = 0.0  # server: the engine-core process and its workers


# ---- offline ----
class Offline:
    """An in-process engine; `run()` times one generate of every prompt."""

    def __init__(self, args: argparse.Namespace, max_num_seqs: int | None = None) -> None:
        from shardserve import LLM

        options = engine_options(args)
        if max_num_seqs is not None:
            options["max_num_seqs"] = max_num_seqs
        self.llm = LLM(args.model, **options)

    def run(self, prompts: list[str], max_tokens: int) -> Sample:
        from shardserve import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        cpu0, t0 = time.process_time(), time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        results = [Result(tokens=len(o.outputs[0].token_ids)) for o in outs]
        return Sample(elapsed, sum(r.tokens for r in results), results, cpu)

    def shutdown(self) -> None:
        self.llm.shutdown()


# ---- server ----
class Server:
    """`shardserve serve` (or the floor prototype) in a subprocess; `run()` times
    --num-clients streaming clients."""

    def __init__(self, args: argparse.Namespace, floor: bool = False) -> None:
        self.args = args
        self.proc, self.url = start_server(args, floor)

    def run(self, prompts: list[str], max_tokens: int) -> Sample:
        cpu0, client0 = tree_cpu_s(self.proc.pid), time.thread_time()
        results, elapsed = asyncio.run(asyncio.wait_for(
            server_round(self.url, prompts, self.args.num_clients, max_tokens),
            self.args.time_limit_s))
        (api1, engine1), client = tree_cpu_s(self.proc.pid), time.thread_time() - client0
        return Sample(elapsed, sum(r.tokens for r in results), results, api1 - cpu0[0],
                      client, engine1 - cpu0[1])

    def shutdown(self) -> None:
        stop_server(self.proc)


def tree_cpu_s(pid: int) -> tuple[float, float]:
    """CPU-seconds (user + system) used so far by a process, and by its live descendants."""
    import psutil

    def cpu(p: psutil.Process) -> float:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            return t.user + t.system
        return 0.0

    root = psutil.Process(pid)
    return cpu(root), sum(cpu(p) for p in root.children(recursive=True))


def start_server(args: argparse.Namespace, floor: bool = False, extra: tuple[str, ...] = ()
                 ) -> tuple[subprocess.Popen, str]:
    """The server process and its URL; it binds a port the OS picks (--port 0) and writes the
    port to --port-file once it serves, so no other process can take it in between. `floor`:
    the floor prototype (bench/_floor_server.py) instead of `shardserve serve`; `extra`: more
    flags for it."""
    opts = engine_options(args)
    port_file = tempfile.mktemp(prefix="shardserve-bench-port-")
    common = ["--port-file", port_file, "--dtype", opts["dtype"], "--max-model-len",
              str(opts["max_model_len"]), "--max-num-seqs", str(opts["max_num_seqs"])]
    if floor:
        cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "_floor_server.py"),
               *common]
    else:
        cmd = [sys.executable, "-m", "shardserve", "serve", "--host", "127.0.0.1", "--port",
               "0", *common, "--uvicorn-log-level", "warning", "--stream-interval",
               str(args.stream_interval)]
    if args.model:
        cmd += ["--model", args.model]
    cmd += list(extra)
    # The server's log goes to a file: an unread pipe could fill up and stall it.
    log = tempfile.NamedTemporaryFile(prefix="shardserve-bench-", suffix=".log", delete=False)
    print(f"server log: {log.name}", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + 180
    url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {open(log.name).read()[-2000:]}")
        try:
            if url is None:  # written (atomically) once the server listens
                with open(port_file) as f:
                    url = f"http://127.0.0.1:{int(f.read())}"
                os.unlink(port_file)
            if floor or httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except (OSError, ValueError, httpx.HTTPError):
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


async def server_round(url: str, prompts: list[str], clients: int, max_tokens: int
                       ) -> tuple[list[Result], float]:
    """Every prompt once, through `clients` concurrent streaming clients (one keep-alive
    connection each, opened before the clock starts)."""
    conns = await asyncio.gather(*(Connection.open(url) for _ in range(clients)))
    try:
        queue: asyncio.Queue[str] = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        results: list[Result] = []

        async def client(conn: Connection) -> None:
            while not queue.empty():
                results.append(await conn.stream_completion(queue.get_nowait(), max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in conns))
        return results, time.perf_counter() - t0
    finally:
        for conn in conns:
            conn.close()


# ---- rounds ----
PHASES = ["offline", "capped", "server"]


def start_phases(args: argparse.Namespace) -> dict[str, Offline | Server]:
    phases: dict[str, Offline | Server] = {}
    try:
        phases["server"] = Server(args)
        phases["offline"] = Offline(args)
        # The server never has more than --num-clients requests in flight; offline at that width
        # isolates the front end's cost from the batch-size effect.
        phases["capped"] = Offline(args, max_num_seqs=args.num_clients)
        if args.floor_prototype:
            phases["floor"] = Server(args, floor=True)
    except BaseException:
        stop_phases(phases)
        raise
    return phases


def stop_phases(phases: dict[str, Offline | Server]) -> None:
    for phase in phases.values():
        phase.shutdown()


def run_rounds(args: argparse.Namespace, prompts: list[str]) -> tuple[Rounds, list[Result]]:
    """All phases stay up; the same warm-up each; then --rounds rounds, phases back to back in
    a rotating order. Only one phase runs at a time; the idle ones sleep. Returns the per-round
    tokens/s and requests/s, and every server request's result (all rounds)."""
    phases = start_phases(args)
    names = [*PHASES, "floor"] if args.floor_prototype else PHASES
    samples, served = Rounds(), []
    try:
        for name in names:
            phases[name].run(prompts, WARMUP_TOKENS)
        for r in range(args.rounds):
            took = {}
            for name in rotated(names, r):
                sample = phases[name].run(prompts, args.max_tokens)
                samples.add(name, sample.tokens / sample.elapsed)
                samples.add((name, "requests/s"), len(sample.results) / sample.elapsed)
                samples.add((name, "cores"), sample.cpu_s / sample.elapsed)
                if name in ("server", "floor"):
                    samples.add((name, "client cores"), sample.client_cpu_s / sample.elapsed)
                    samples.add((name, "engine cores"), sample.engine_cpu_s / sample.elapsed)
                took[name] = sample.elapsed
                if name == "server":
                    served += sample.results
                if name == "floor" and not all(r.ok for r in sample.results):
                    raise RuntimeError("the floor prototype failed requests")
            print(f"round {r + 1}/{args.rounds}: offline {took['offline']:.2f} s, "
                  f"{args.num_clients} at a time {took['capped']:.2f} s, "
                  f"server {took['server']:.2f} s"
                  + (f", floor prototype {took['floor']:.2f} s" if "floor" in took else ""),
                  flush=True)
    finally:
        stop_phases(phases)
    return samples, served


# ---- report ----
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def report(args: argparse.Namespace, s: Rounds, served: list[Result]) -> None:
    failed = sum(not r.ok for r in served)
    ttft = [r.ttft for r in served]
    gaps = [g for r in served for g in r.gaps]
    n = args.num_clients
    vs_offline, vs_capped = s.ratios("server", "offline"), s.ratios("server", "capped")
    print(f"\nmodel={args.model or 'default'} dtype={args.dtype} clients={n} "
          f"stream_interval={args.stream_interval} "
          f"requests={args.num_requests} x {args.rounds} rounds (failed {failed}) "
          f"max_tokens={args.max_tokens}; ratios: median of per-round ratios")
    print(f"| {'metric':<34} | {'value':>10} | {'range':>13} |\n|{'-' * 36}|{'-' * 12}|{'-' * 15}|")
    rows = [("offline output tokens/s", s.median("offline"), ""),
            ("server output tokens/s", s.median("server"), ""),
            ("server / offline", median_or_nan(vs_offline), spread(vs_offline)),
            (f"offline, {n} at a time, tokens/s", s.median("capped"), ""),
            (f"server / offline {n} at a time", median_or_nan(vs_capped), spread(vs_capped)),
            ("server requests/s", s.median(("server", "requests/s")), ""),
            ("offline CPU (cores)", s.median(("offline", "cores")), ""),
            ("server CPU: API process (cores)", s.median(("server", "cores")), ""),
            ("server CPU: engine + workers (cores)", s.median(("server", "engine cores")), ""),
            ("light client CPU (cores)", s.median(("server", "client cores")), ""),
            ("TTFT p50 (ms, all rounds)", 1000 * pct(ttft, 50), ""),
            ("TTFT p99 (ms, all rounds)", 1000 * pct(ttft, 99), ""),
            ("ITL p50 (ms, all rounds)", 1000 * pct(gaps, 50), ""),
            ("ITL p99 (ms, all rounds)", 1000 * pct(gaps, 99), "")]
    if args.floor_prototype:
        vs_floor = s.ratios("floor", "capped")
        rows += [(f"floor prototype / offline {n} at a time", median_or_nan(vs_floor),
                  spread(vs_floor)),
                 ("floor prototype CPU: front end (cores)", s.median(("floor", "cores")), ""),
                 ("floor prototype: light client (cores)", s.median(("floor", "client cores")),
                  "")]
    for name, value, rng in rows:
        print(f"| {name:<34} | {value:>10.2f} | {rng:>13} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-clients", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=3,
                        help="interleaved rounds; ratios are the median of per-round ratios")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the server's --stream-interval (tokens per streamed event)")
    parser.add_argument("--floor-prototype", action="store_true",
                        help="also time bench/_floor_server.py (the least a Python front end "
                        "can do) as a fourth phase")
    parser.add_argument("--time-limit-s", type=float, default=150.0,
                        help="a server round is cancelled after this long")
    _guidellm.add_arguments(parser)
    args = parser.parse_args()
    if not args.no_light_client:
        samples, served = run_rounds(args, make_prompts(args.num_requests))
        report(args, samples, served)
    if not args.no_guidellm:
        _guidellm.run_part(args, start_server, stop_server, Offline, warm_server)


def warm_server(url: str, width: int) -> None:
    """The same warm-up as the rounds': `width` prompts at once, WARMUP_TOKENS new tokens."""
    asyncio.run(server_round(url, make_prompts(width), width, WARMUP_TOKENS))


if __name__ == "__main__":
    main()
