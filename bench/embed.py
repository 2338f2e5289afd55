"""Embeddings/s of LLM.embed (runner="pooling", last-token pooling, normalized) beside HF
transformers' AutoModel on the same weights, in one run: interleaved rounds (the first side
rotating), the median of per-round ratios, both sides on the same torch thread count.

    python bench/embed.py [--rounds 3] [--model PATH] [--dtype float32] [--ours auto,float32]
                          [--threads N] [--singles 16] [--batch 64]

transformers runs in --dtype; shardserve once per --ours dtype ("auto" on the default GGUF
computes from its quantized blocks where the CPU has no native bfloat16), each a side of its
own.

Both sides get the same token ids (tokenization is not timed on either side). Batch 1: --singles
prompts one call each; batch --batch: one call with all of them (HF pads to the longest and
reads each prompt's last real position, as an HF embedding loop does). Sides agree: the cosine
of their vectors is printed.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from _rounds import Rounds, make_prompts, rotated, spread

from shardserve import LLM
from shardserve.model.loader import default_model_path

HF = "transformers"


class HfSide:
    """transformers' base model (no LM head): final hidden states, last real token, L2."""

    def __init__(self, path: str | None, dtype: torch.dtype) -> None:
        import transformers

        model = default_model_path() if path is None else path
        kwargs = {"gguf_file": os.path.basename(model)} if str(model).endswith(".gguf") else {}
        folder = os.path.dirname(model) if kwargs else model
        self.model = transformers.AutoModel.from_pretrained(folder, dtype=dtype,
                                                            **kwargs).eval()

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        lengths = torch.tensor([len(ids) for ids in batch])
        ids = torch.zeros(len(batch), int(lengths.max()), dtype=torch.long)
        for i, row in enumerate(batch):
            ids[i, :len(row)] = torch.tensor(row)
        mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(batch)), lengths - 1].float()
        return torch.nn.functional.normalize(last, dim=-1)


def ours(llm: LLM, batch: list[list[int]]) -> torch.Tensor:
    outs = llm.embed([{"prompt_token_ids": ids} for ids in batch], use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs])


def measure(fn, singles: list[list[int]], batch: list[list[int]]) -> tuple[float, float]:
    """(embeddings/s at batch 1, at batch len(batch))."""
    t0 = time.perf_counter()
    for ids in singles:
        fn([ids])
    one = len(singles) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    fn(batch)
    return one, len(batch) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--ours", default="auto,float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--singles", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = {f"shardserve {d}": LLM(args.model, runner="pooling", dtype=d, max_model_len=512,
                                      max_num_seqs=args.batch) for d in args.ours.split(",")}
    hf = HfSide(args.model, getattr(torch, args.dtype))
    torch.set_num_threads(args.threads)  # the same count for every side, whatever LLM set
    tok = next(iter(engines.values())).get_tokenizer()
    texts = [f"{p} {p.lower()} and what follows from it" for p in make_prompts(args.batch)]
    batch = [tok.encode(t) for t in texts]
    singles = batch[:args.singles]
    sides = {name: (lambda b, llm=llm: ours(llm, b)) for name, llm in engines.items()}
    sides[HF] = hf.embed
    reference = hf.embed(batch)
    cosines = {name: float(torch.nn.functional.cosine_similarity(fn(batch), reference).min())
               for name, fn in sides.items() if name != HF}
    samples = Rounds()
    try:
        for r in range(args.rounds):
            for side in rotated(list(sides), r):
                one, many = measure(sides[side], singles, batch)
                samples.add((side, 1), one)
                samples.add((side, args.batch), many)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    report(samples, args, cosines, sum(map(len, batch)) / len(batch))


def report(samples: Rounds, args: argparse.Namespace, cosines: dict[str, float],
           mean_len: float) -> None:
    print(f"\ntransformers {args.dtype}, {torch.get_num_threads()} threads, {args.rounds} "
          f"interleaved rounds; prompts of {mean_len:.0f} tokens on average")
    print(f"{'side':<22} {'batch':>5} {'emb/s':>9} {'transformers':>13} {'ratio':>7} "
          f"{'range':>12} {'min cosine':>11}")
    for name, cosine in cosines.items():
        for size in (1, args.batch):
            ratios = samples.ratios((name, size), (HF, size))
            print(f"{name:<22} {size:>5} {samples.median((name, size)):>9.1f} "
                  f"{samples.median((HF, size)):>13.1f} "
                  f"{samples.ratio((name, size), (HF, size)):>6.2f}x {spread(ratios):>12} "
                  f"{cosine:>11.6f}")


if __name__ == "__main__":
    main()
