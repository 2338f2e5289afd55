"""LoRA serving cost: generation with adapters against the base model alone, default model.

    python bench/lora.py [--rounds 3] [--max-tokens 64] [--rank 16] [--adapters 4]
                         [--batch 1,32] [--dtype auto]

Two engines stay up: `base` (no LoRA) and `lora` (enable_lora, max_loras = --adapters, rank-16
adapters on all seven projections, written as peft saves them: adapter_config.json +
adapter_model.safetensors with random non-zero weights at the model's shapes). Per round, each
batch size runs on both, the first side rotating from round to round:
  batch 32  32 greedy requests in one generate; on `lora` they use --adapters distinct adapters
            (request i takes adapter i mod --adapters): every step mixes them
  batch 1   one request at a time (the prompts in turn); on `lora` each uses adapter 1
Reported: decode tokens/s of each side (generated tokens over the generate's wall time) and
lora/base (median of per-round ratios, with their range). The issue's targets: >= 0.8 at batch
32, >= 0.85 at batch 1.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from _rounds import Rounds, make_prompts, rotated, spread
from safetensors.torch import save_file

from shardserve import LLM, LoRARequest, SamplingParams

PROJECTIONS = {  # HF module -> (its parent, input size key, output size key)
    "q_proj": ("self_attn", "hidden", "q"), "k_proj": ("self_attn", "hidden", "kv"),
    "v_proj": ("self_attn", "hidden", "kv"), "o_proj": ("self_attn", "q", "hidden"),
    "gate_proj": ("mlp", "hidden", "inter"), "up_proj": ("mlp", "hidden", "inter"),
    "down_proj": ("mlp", "inter", "hidden"),
}


def write_adapter(folder: Path, arch, rank: int, seed: int) -> Path:
    """A rank-`rank` adapter of every projection of every layer, as peft writes one."""
    sizes = {"hidden": arch.hidden_size, "q": arch.num_heads * arch.head_dim,
             "kv": arch.num_kv_heads * arch.head_dim, "inter": arch.intermediate_size}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for name, (parent, fan_in, fan_out) in PROJECTIONS.items():
            key = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, sizes[fan_in], generator=g) / \
                sizes[fan_in] ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(sizes[fan_out], rank, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
              "target_modules": list(PROJECTIONS), "bias": "none", "use_rslora": False,
              "use_dora": False, "modules_to_save": None, "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def generate(llm: LLM, prompts: list[str], params: SamplingParams,
             loras: list[LoRARequest] | None, batch: int) -> tuple[float, int]:
    """(seconds, generated tokens) of the prompts at this batch size."""
    t0 = time.perf_counter()
    tokens = 0
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        lora = None if loras is None else loras[start:start + batch]
        outs = llm.generate(chunk, params, use_tqdm=False, lora_request=lora)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--batch1-prompts", type=int, default=4)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    base = LLM(dtype=args.dtype, max_model_len=512)
    lora = LLM(dtype=args.dtype, max_model_len=512, enable_lora=True,
               max_loras=args.adapters, max_lora_rank=args.rank)
    arch = lora.config.model_config.arch
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(tmp / f"a{i}", arch, args.rank,
                                                              seed=i)))
                for i in range(args.adapters)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    sets = {b: make_prompts(32 if b > 1 else args.batch1_prompts) for b in batches}
    loras = {b: [adapters[i % len(adapters)] if b > 1 else adapters[0]
                 for i in range(len(sets[b]))] for b in batches}
    for b in batches:  # warm-up: kernels built, adapters loaded, caches touched
        generate(base, sets[b][:2], params, None, b)
        generate(lora, sets[b][:2], params, loras[b][:2], b)
    samples = Rounds()
    for r in range(args.rounds):
        for b in batches:
            for side in rotated(["base", "lora"], r):
                llm = base if side == "base" else lora
                secs, tokens = generate(llm, sets[b], params, None if side == "base"
                                        else loras[b], b)
                samples.add((b, side), tokens / secs)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    threads = torch.get_num_threads()
    print(f"\ndefault model, dtype {args.dtype}, {threads} threads, rank {args.rank}, "
          f"{args.adapters} adapters, {args.max_tokens} tokens, {args.rounds} rounds")
    print("| batch | base tok/s | lora tok/s | lora / base (median, range) |")
    print("|---|---|---|---|")
    for b in batches:
        ratios = samples.ratios((b, "lora"), (b, "base"))
        print(f"| {b} | {samples.median((b, 'base')):.1f} | {samples.median((b, 'lora')):.1f} | "
              f"{samples.ratio((b, 'lora'), (b, 'base')):.2f} ({spread(ratios)}) |")
    base.shutdown()
    lora.shutdown()


if __name__ == "__main__":
    main()
