"""Random-weight GGUF files at real Llama shapes, for measuring speed at real sizes.

    python bench/make_gguf.py --shape 1b --out /tmp/gguf/llama-1b-q4km.gguf \
        --llama-quantize /tmp/llamacpp/bin-native/llama-quantize [--type Q4_K_M] [--keep-f16]
    python bench/make_gguf.py --shape 1b --layers 2 --hidden 64 --ffn 128 --heads 4 \
        --kv-heads 2 --out small.gguf          # F16 only (no --llama-quantize), e.g. for tests

Shapes (Llama 3.2 1B / 3B, Llama 3.1 8B; the vocabulary is the default model's, 49,152):
    1b: hidden 2048, 16 layers, 32 heads / 8 KV heads, FFN 8192
    3b: hidden 3072, 28 layers, 24 / 8, FFN 8192
    8b: hidden 4096, 32 layers, 32 / 8, FFN 14336
`--hidden/--layers/--heads/--kv-heads/--ffn` override the chosen shape's entries.

The file carries the default model's tokenizer (every `tokenizer.ggml.*` key and the chat
template), general.architecture llama with the llama.* hyperparameters (rope theta 500000,
RMS eps 1e-5, context 8192), and tensors under llama.cpp's names, an untied `output.weight`
included. Matrices are F16 drawn from N(0, 0.02^2) (so activations stay finite through the
layers), norm weights F32 ones. Each tensor is generated and written a chunk of rows at a time
from a generator seeded by (--seed, tensor index), so an 8B F16 file (16 GB) never sits in
memory and the same seed gives the same bytes. With `--llama-quantize PATH` the F16 file is
then quantized by llama.cpp's own tool (`llama-quantize F16 OUT TYPE THREADS`) and deleted
unless --keep-f16. Write big files outside the repository (/tmp); check `df -h` first
(8b: 16 GB F16 + 4.9 GB Q4_K_M).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

CHUNK_ELEMENTS = 1 << 24  # 16 M values (64 MB as float32) generated at a time


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    context: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
    "8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
}


def tensor_plan(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape (rows = outputs, columns = inputs)) of every tensor, in file order."""
    h, d = shape.hidden, shape.head_dim
    plan: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, h))]
    for i in range(shape.layers):
        b = f"blk.{i}"
        plan += [
            (f"{b}.attn_norm.weight", (h,)),
            (f"{b}.attn_q.weight", (shape.heads * d, h)),
            (f"{b}.attn_k.weight", (shape.kv_heads * d, h)),
            (f"{b}.attn_v.weight", (shape.kv_heads * d, h)),
            (f"{b}.attn_output.weight", (h, shape.heads * d)),
            (f"{b}.ffn_norm.weight", (h,)),
            (f"{b}.ffn_gate.weight", (shape.ffn, h)),
            (f"{b}.ffn_up.weight", (shape.ffn, h)),
            (f"{b}.ffn_down.weight", (h, shape.ffn)),
        ]
    plan += [("output_norm.weight", (h,)), ("output.weight", (vocab, h))]
    return plan


def parameter_count(shape: Shape, vocab: int) -> int:
    return sum(int(np.prod(s)) for _, s in tensor_plan(shape, vocab))


def tokenizer_fields(source: Path) -> list[tuple[str, object, object, object]]:
    """(key, value, type, array item type) of the source file's tokenizer keys.

    Read with shardserve's own parser (gguf.GGUFReader takes seconds over 49k tokens); the
    value types follow llama.cpp's conventions: ids UINT32, token types INT32, scores FLOAT32.
    """
    import gguf

    from shardserve.model.gguf_loader import read_gguf

    t = gguf.GGUFValueType
    scalar = {bool: t.BOOL, str: t.STRING, int: t.UINT32, float: t.FLOAT32}
    item = {str: t.STRING, int: t.INT32, float: t.FLOAT32, bool: t.BOOL}
    gf, _ = read_gguf(source)
    out: list[tuple[str, object, object, object]] = []
    for key, value in gf.metadata.items():
        if not (key.startswith("tokenizer.ggml.") or key == "tokenizer.chat_template"):
            continue
        if isinstance(value, list | tuple):
            out.append((key, list(value), t.ARRAY, item[type(value[0])]))
        else:
            out.append((key, value, scalar[type(value)], None))
    return out


def _chunks(rng: np.random.Generator, shape: tuple[int, ...]) -> Iterator[np.ndarray]:
    """The tensor's values as float16 row blocks: N(0, 0.02^2) for matrices, ones for norms."""
    if len(shape) == 1:
        yield np.ones(shape, dtype=np.float32)
        return
    rows, cols = shape
    step = max(1, CHUNK_ELEMENTS // cols)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        block = rng.standard_normal((n, cols), dtype=np.float32)
        block *= 0.02
        yield block.astype(np.float16)


def write_f16(path: Path, shape: Shape, seed: int, source: Path, name: str) -> int:
    """Write the F16 file; returns its size in bytes."""
    import gguf

    fields = tokenizer_fields(source)
    vocab = next(len(v) for k, v, _, _ in fields if k == "tokenizer.ggml.tokens")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_vocab_size(vocab)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    for key, value, vtype, sub in fields:
        w.add_key_value(key, value, vtype, sub_type=sub)
    plan = tensor_plan(shape, vocab)
    for tname, tshape in plan:
        dtype = np.float32 if len(tshape) == 1 else np.float16
        w.add_tensor_info(tname, tshape, np.dtype(dtype), int(np.prod(tshape)) * dtype().itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    fout = w.fout[0]
    for index, (_, tshape) in enumerate(plan):
        # Write the data ourselves, a chunk at a time, with the writer's alignment padding
        # (what GGUFWriter.write_tensor_data does for a whole tensor).
        w.write_padding(fout, fout.tell())
        rng = np.random.default_rng([seed, index])
        nbytes = 0
        for block in _chunks(rng, tshape):
            block.tofile(fout)
            nbytes += block.nbytes
        w.write_padding(fout, nbytes)
    w.close()
    return path.stat().st_size


def quantize(tool: str, f16: Path, out: Path, qtype: str, threads: int) -> None:
    done = subprocess.run([tool, str(f16), str(out), qtype, str(threads)], text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{tool} exited {done.returncode}:\n{done.stdout[-3000:]}")


def parse_shape(args: argparse.Namespace) -> Shape:
    base = SHAPES[args.shape]
    overrides = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "ffn")
                 if getattr(args, k) is not None}
    shape = dataclasses.replace(base, **overrides)
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise SystemExit(f"hidden must divide by heads and heads by kv-heads: {shape}")
    return shape


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    for k in ("hidden", "layers", "heads", "kv-heads", "ffn"):
        parser.add_argument(f"--{k}", type=int, default=None, help="override the shape's entry")
    parser.add_argument("--out", required=True, help="the output .gguf (F16 without a quantizer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type name")
    parser.add_argument("--llama-quantize", default=None, help="path of llama.cpp's llama-quantize")
    parser.add_argument("--threads", type=int, default=2, help="llama-quantize's threads")
    parser.add_argument("--keep-f16", action="store_true")
    parser.add_argument("--tokenizer-from", default=None,
                        help="GGUF to copy the tokenizer from (default: the default model)")
    args = parser.parse_args(argv)
    shape = parse_shape(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.tokenizer_from:
        source = Path(args.tokenizer_from)
    else:
        from shardserve.model.loader import default_model_path

        source = Path(default_model_path())
    f16 = out if args.llama_quantize is None else out.with_name(out.stem + ".f16.gguf")
    t0 = time.perf_counter()
    name = f"random llama {args.shape} (hidden {shape.hidden}, {shape.layers} layers)"
    size = write_f16(f16, shape, args.seed, source, name)
    print(f"{f16}: {size / 1e9:.2f} GB F16 in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.llama_quantize is None:
        return f16
    t0 = time.perf_counter()
    try:
        quantize(args.llama_quantize, f16, out, args.type, args.threads)
    finally:
        if not args.keep_f16:
            os.unlink(f16)
    print(f"{out}: {out.stat().st_size / 1e9:.2f} GB {args.type} in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
