"""Data parallelism on this machine: DP=2 (two engine replicas, one thread each) against DP=1
(one engine, two threads), offline and served, in one run, and the front end's routing cost.

    python bench/dp.py [--rounds 3] [--prompts 64] [--tokens 128] [--clients 64] [--dtype auto]

Sides, all kept up and measured back to back in every round (order rotating): offline DP=1 and
DP=2 (`LLM(data_parallel_size=...)`, 64 prompts x 128 tokens in one generate), and served DP=1
and DP=2 (`shardserve serve --data-parallel-size ...`, --clients concurrent streaming clients).
Ratios DP=2 / DP=1 are taken per round; the table shows their median and range. Threads: a
replica takes the machine's cores divided by the replicas (SHARDSERVE_NUM_THREADS overrides).

Routing cost, with the DP=2 offline engine: the router's decision alone (ReplicaRouter.assign),
and the whole hand-over of a processed request to a replica (the decision, pickling, the ZMQ
send: MPClient.add_requests), per request. Target (issue 16) on 2 cores: DP=2 >= 0.9x DP=1,
routing <= 50 us a request.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from _rounds import Rounds, make_prompts, median_or_nan, rotated, spread
from serve import server_round, start_server, stop_server

from shardserve import LLM, SamplingParams
from shardserve.engine.dp_router import ReplicaRouter

WARMUP_TOKENS = 4


class OfflineSide:
    def __init__(self, args: argparse.Namespace, dp: int) -> None:
        self.llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=128,
                       data_parallel_size=dp)

    def run(self, prompts: list[str], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)

    def close(self) -> None:
        self.llm.shutdown()


class ServedSide:
    def __init__(self, args: argparse.Namespace, dp: int) -> None:
        self.clients = args.clients
        self.proc, self.url = start_server(args, extra=("--max-num-seqs", "128",
                                                        "--data-parallel-size", str(dp)))

    def run(self, prompts: list[str], tokens: int) -> float:
        results, elapsed = asyncio.run(server_round(self.url, prompts, self.clients, tokens))
        if not all(r.ok for r in results):
            raise RuntimeError("the server failed requests")
        return sum(r.tokens for r in results) / elapsed

    def close(self) -> None:
        stop_server(self.proc)


def routing_cost(llm: LLM, n: int) -> tuple[float, float]:
    """(decision us, hand-over us) per request, on the DP=2 engine."""
    router = ReplicaRouter(2)
    t0 = time.perf_counter()
    for i in range(20 * n):
        router.assign([f"x{i}"])
    decision = (time.perf_counter() - t0) / (20 * n)
    engine = llm.engine
    params = SamplingParams(max_tokens=1)
    processed = [engine.inputs.process(f"route-{i}", "Hello", params) for i in range(n)]
    for req in processed:
        engine.processor.add_request(req.request_id, req.prompt, req.prompt_token_ids,
                                     req.children)
    t0 = time.perf_counter()
    for req in processed:
        engine.client.add_requests(req.core_requests())
    handover = (time.perf_counter() - t0) / n
    while engine.has_unfinished_requests():
        engine.step()
    return 1e6 * decision, 1e6 * handover


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--no-served", action="store_true", help="offline sides only")
    args = parser.parse_args()
    args.stream_interval = 1  # serve.start_server's flag
    prompts = make_prompts(args.prompts)
    makers = {"offline DP=1": lambda: OfflineSide(args, 1),
              "offline DP=2": lambda: OfflineSide(args, 2)}
    if not args.no_served:
        makers |= {"served DP=1": lambda: ServedSide(args, 1),
                   "served DP=2": lambda: ServedSide(args, 2)}
    sides: dict = {}
    samples = Rounds()
    try:
        for name, make in makers.items():
            sides[name] = make()
            sides[name].run(prompts, WARMUP_TOKENS)
        for r in range(args.rounds):
            for name in rotated(list(sides), r):
                samples.add(name, sides[name].run(prompts, args.tokens))
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        decision, handover = routing_cost(sides["offline DP=2"].llm, 256)
    finally:
        for side in sides.values():
            side.close()
    print(f"\n{args.prompts} prompts x {args.tokens} tokens, {args.rounds} rounds, "
          f"dtype={args.dtype}; tokens/s medians, DP=2 / DP=1 per round")
    print(f"| {'side':<14} | {'DP=1 tok/s':>10} | {'DP=2 tok/s':>10} | {'DP=2 / DP=1':>11} | "
          f"{'range':>11} |")
    for kind in ("offline", "served"):
        if f"{kind} DP=1" not in sides:
            continue
        ratios = samples.ratios(f"{kind} DP=2", f"{kind} DP=1")
        print(f"| {kind:<14} | {samples.median(f'{kind} DP=1'):>10.1f} | "
              f"{samples.median(f'{kind} DP=2'):>10.1f} | {median_or_nan(ratios):>10.2f}x | "
              f"{spread(ratios):>11} |")
    print(f"routing: decision {decision:.2f} us / request, hand-over to a replica (decision, "
          f"pickle, send) {handover:.1f} us / request")


if __name__ == "__main__":
    main()
