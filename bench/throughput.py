"""Offline throughput: shardserve vs HF transformers on the default model, in one run.

    python bench/throughput.py [--num-prompts 64] [--max-tokens 128] [--dtypes float32,bfloat16]
                               [--widths 32,64] [--rounds 3] [--logits-controls]

For every dtype and batch width w (--widths): output tokens/s of shardserve with max_num_seqs=w
(continuous batching over all prompts) and of HF transformers' batched `generate` in batches of
w (left padding), greedy, exactly --max-tokens new tokens per prompt. Then shardserve's batch-1
decode tokens/s beside a memory-bandwidth bound: weight bytes / read bandwidth, where the read
bandwidth is the best of 3 `sum()` over a 512 MiB float32 buffer (16x this VM's L3 cache),
measured in the same round just before that decode.

How the ratios are computed: both sides get the same warm-up (one untimed run of the same
prompts at the same width with 4 new tokens) before the rounds. Then, --rounds times, at each
width shardserve and HF run back to back (which goes first alternates from round to round), and
the ratio shardserve / HF is taken within that round; the table shows the median of the
per-round ratios and their range. The tok/s columns are medians over the rounds, and "of bound"
is the median of the per-round decode / bound.

--logits-controls adds a third side: shardserve with a logit_bias (16 tokens, small biases) and
bad_words on every request, run back to back with the plain shardserve side and HF in each
round; a last table shows ours without and with the controls and the per-round ratio with /
without (median, range: the batched controls should cost ~nothing, >= 0.95x). Issue 28's check
is at batch 32: `--widths 32 --logits-controls`.

Threads: HF (and the bandwidth probe) run on the thread shardserve's in-process workers use
(`uniproc.worker_thread()`), so the process has one OpenMP pool, as each side has when it runs
alone; with two pools on two cores libgomp stops spinning between kernels and both sides slow.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from _rounds import Rounds, make_prompts, median_or_nan, rotated, spread, timed

from shardserve import LLM, SamplingParams
from shardserve.executor.uniproc import worker_thread
from shardserve.model.loader import default_model_path

WARMUP_TOKENS = 4
DECODE_STEPS = 64
BW_BUFFER_FLOATS = 128 * 2**20  # 512 MiB of float32
# --logits-controls: what every request carries (small biases: the text stays the model's).
LOGITS_CONTROLS = {"logit_bias": {t: 0.5 - (t % 3) * 0.25 for t in range(1000, 1016)},
                   "bad_words": ["banana split", "xylophone", "Furthermore"]}
CONTROLS_SIDE = "ours+controls"


def on_worker_thread(fn, *args):
    """Run torch work on shardserve's in-process worker thread (one OpenMP pool in all)."""
    return worker_thread().submit(fn, *args).result()


def read_bandwidth(buf: torch.Tensor, repeats: int = 3) -> float:
    """Bytes read per second by a reduction over `buf` (best of `repeats`)."""
    best = min(on_worker_thread(timed, buf.sum) for _ in range(repeats))
    return buf.numel() * buf.element_size() / best


def ours_tok_s(llm: LLM, prompts: list[str], max_tokens: int,
               controls: dict | None = None) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            **(controls or {}))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def decode1(llm: LLM, prompt: str, steps: int = DECODE_STEPS) -> float:
    """Batch-1 decode tokens/s: a (1 + steps)-token minus a 1-token generation isolates decode."""
    one = [prompt]
    t1 = timed(lambda: llm.generate(one, SamplingParams(max_tokens=1), use_tqdm=False))
    params = SamplingParams(max_tokens=1 + steps, ignore_eos=True, temperature=0)
    tn = timed(lambda: llm.generate(one, params, use_tqdm=False))
    return steps / (tn - t1)


def hf_tok_s(model, tokenizer, prompts: list[str], max_tokens: int, batch: int) -> float:
    return on_worker_thread(_hf_tok_s, model, tokenizer, prompts, max_tokens, batch)


def _hf_tok_s(model, tokenizer, prompts: list[str], max_tokens: int, batch: int) -> float:
    tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        enc = tokenizer(prompts[i : i + batch], return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        tokens += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    return tokens / (time.perf_counter() - t0)


def load_hf():
    import transformers

    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    return model, tok


class DtypeBench:
    """One shardserve engine per width and the HF model in this dtype, all warm."""

    def __init__(self, dtype: str, hf_model, hf_tok, prompts: list[str], args) -> None:
        self.prompts, self.args, self.hf_tok = prompts, args, hf_tok
        self.widths = [int(w) for w in args.widths.split(",")]
        self.controls = LOGITS_CONTROLS if args.logits_controls else None
        self.hf = on_worker_thread(hf_model.to, getattr(torch, dtype))
        self.engines = {
            w: LLM(dtype=dtype, max_model_len=1024, max_num_seqs=w) for w in self.widths
        }
        runner = self.engines[self.widths[0]].engine.core.executor.worker.model_runner
        self.weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        for w in self.widths:  # the same untimed short run for each side, at each width
            ours_tok_s(self.engines[w], prompts, WARMUP_TOKENS)
            if self.controls:
                ours_tok_s(self.engines[w], prompts, WARMUP_TOKENS, self.controls)
            hf_tok_s(self.hf, hf_tok, prompts, WARMUP_TOKENS, w)
        decode1(self.engines[self.widths[-1]], prompts[0], steps=4)

    def round(self, r: int, samples: Rounds, buf: torch.Tensor) -> None:
        """Each width: every side back to back (rotating order); then bandwidth + decode."""
        n = self.args.max_tokens
        sides = {
            "ours": lambda w: ours_tok_s(self.engines[w], self.prompts, n),
            "hf": lambda w: hf_tok_s(self.hf, self.hf_tok, self.prompts, n, w),
        }
        if self.controls:
            sides[CONTROLS_SIDE] = lambda w: ours_tok_s(self.engines[w], self.prompts, n,
                                                        self.controls)
        for w in self.widths:
            for side in rotated(list(sides), r):
                samples.add((side, w), sides[side](w))
        bw = read_bandwidth(buf)
        tok_s = decode1(self.engines[self.widths[-1]], self.prompts[0])
        samples.add("bw", bw)
        samples.add("decode1", tok_s)
        samples.add("of_bound", tok_s / (bw / self.weight_bytes))
        line = ", ".join(
            f"b={w} {samples.values(('ours', w))[-1]:.0f} vs "
            f"{samples.values(('hf', w))[-1]:.0f} tok/s"
            + (f" (ours with controls {samples.values((CONTROLS_SIDE, w))[-1]:.0f})"
               if self.controls else "")
            for w in self.widths
        )
        print(
            f"  round {r + 1}/{self.args.rounds}: {line}; b=1 decode {tok_s:.1f} tok/s, "
            f"read {bw / 1e9:.1f} GB/s",
            flush=True,
        )

    def shutdown(self) -> None:
        for llm in self.engines.values():
            llm.shutdown()


def bench_dtype(
    dtype: str, hf_model, hf_tok, prompts: list[str], args, buf: torch.Tensor
) -> tuple[Rounds, int]:
    print(f"{dtype}:", flush=True)
    bench = DtypeBench(dtype, hf_model, hf_tok, prompts, args)
    samples = Rounds()
    try:
        for r in range(args.rounds):
            bench.round(r, samples, buf)
    finally:
        bench.shutdown()
    return samples, bench.weight_bytes


def report(rows: list[tuple[str, Rounds, int]], widths: list[int], args) -> None:
    print(
        f"\n{args.num_prompts} prompts x {args.max_tokens} new tokens, default model, "
        f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds; "
        "ratio = median of per-round shardserve / HF (range)"
    )
    print(
        f"{'dtype':<10}{'width':>6}{'shardserve tok/s':>18}{'HF tok/s':>10}{'ratio':>8}"
        f"{'range':>12}"
    )
    for dtype, s, _ in rows:
        for w in widths:
            ratios = s.ratios(("ours", w), ("hf", w))
            print(
                f"{dtype:<10}{w:>6}{s.median(('ours', w)):>18.1f}{s.median(('hf', w)):>10.1f}"
                f"{median_or_nan(ratios):>7.2f}x{spread(ratios):>12}"
            )
    print(
        "\nbatch-1 decode vs the memory-bandwidth bound (weight bytes / read bandwidth of the "
        "same round); medians over rounds"
    )
    print(
        f"{'dtype':<10}{'weights MB':>11}{'read GB/s':>11}{'b=1 decode tok/s':>18}"
        f"{'bound tok/s':>13}{'of bound':>10}{'range':>12}"
    )
    for dtype, s, weight_bytes in rows:
        bound = s.median("bw") / weight_bytes
        of_bound = s.values("of_bound")
        print(
            f"{dtype:<10}{weight_bytes / 1e6:>11.0f}{s.median('bw') / 1e9:>11.1f}"
            f"{s.median('decode1'):>18.1f}{bound:>13.1f}{median_or_nan(of_bound):>9.0%}"
            f"{spread([100 * x for x in of_bound], '.0f') + '%':>12}"
        )


def report_controls(rows: list[tuple[str, Rounds, int]], widths: list[int]) -> None:
    """--logits-controls: ours without and with them, the ratio with / without per round."""
    print("\nlogits controls (logit_bias + bad_words on every request): shardserve with / "
          "without, median of per-round ratios (range)")
    print(f"{'dtype':<10}{'width':>6}{'without tok/s':>15}{'with tok/s':>12}{'ratio':>8}"
          f"{'range':>12}")
    for dtype, s, _ in rows:
        for w in widths:
            ratios = s.ratios((CONTROLS_SIDE, w), ("ours", w))
            print(f"{dtype:<10}{w:>6}{s.median(('ours', w)):>15.1f}"
                  f"{s.median((CONTROLS_SIDE, w)):>12.1f}{median_or_nan(ratios):>7.2f}x"
                  f"{spread(ratios):>12}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--widths", default="32,64", help="batch widths, both sides (max_num_seqs)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; median ratio")
    ap.add_argument("--logits-controls", action="store_true",
                    help="also shardserve with logit_bias and bad_words on every request, "
                    "beside it without them (the ratio with / without)")
    args = ap.parse_args()
    prompts = make_prompts(args.num_prompts)
    buf = on_worker_thread(torch.ones, BW_BUFFER_FLOATS)
    hf_model, hf_tok = on_worker_thread(load_hf)
    rows = []
    for dtype in args.dtypes.split(","):
        rows.append((dtype, *bench_dtype(dtype, hf_model, hf_tok, prompts, args, buf)))
        gc.collect()
    widths = [int(w) for w in args.widths.split(",")]
    report(rows, widths, args)
    if args.logits_controls:
        report_controls(rows, widths)


if __name__ == "__main__":
    main()
