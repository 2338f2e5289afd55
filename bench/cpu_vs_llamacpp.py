"""shardserve (each quantization) against llama.cpp on the same GGUF file, on this CPU, in one run.

    python bench/cpu_vs_llamacpp.py [--rounds 3] [--model PATH.gguf] [--threads 2]
        [--sides gguf,gguf-layerwise,gguf-nodense,gguf-x8,gguf-noamx,gguf-kvbf16,none-bf16,
                 none-f32,int8]
        [--isa native|avx2|portable] [--llama-python PATH] [--llama-requests 4]
    python bench/cpu_vs_llamacpp.py --llama-bin /tmp/llamacpp --model /tmp/gguf/llama-1b-q4km.gguf
        [--isa native|avx2] [--sides gguf,gguf-nodense] [--batches 1,8,32] [--plot out.png]

--isa sets SHARDSERVE_ISA for shardserve (the kernels' instruction set) and, with --llama-bin,
picks llama.cpp's binaries DIR/bin-<isa> (../shared/bench/build_llama_cpp.sh DIR native|avx2).
Below native it also holds torch's own code (ATen's kernels, MKL's sgemm under its flash
attention, oneDNN) to that level, so a forced level runs as on a CPU that has only it.
Both tables run every side at --threads (SHARDSERVE_NUM_THREADS, llama.cpp's -t).
Side gguf-nodense is gguf with SHARDSERVE_QUANT_DENSE_BATCHES=0 (no dense weight copy),
gguf-x8 gguf with SHARDSERVE_INT8_ACTIVATIONS=1 (int8 activations in the row kernels),
gguf-noamx gguf with SHARDSERVE_AMX=0 (batched bfloat16 products on AVX-512, not AMX tiles).

With --llama-bin (or --table real): the real-size table (bench/_real_size.py), every side a
fresh process per round: resident memory after load, load time, cold start (and minus a bare
`import torch` of the same round), prefill tok/s (--pp 512: llama-bench's pp512), batch-1 decode
(--tg 128: llama-bench's tg128), decode tok/s at each of --batches (llama-batched-bench's S_TG;
bench/_shardserve_side.py says how shardserve's figure matches it), ratios side by side, the
weights' bytes read per batch-1 token against the read bandwidth measured in the same round,
and with --plot FILE.png decode tok/s against batch size (needs matplotlib: the bench extra).

Without it, the classic table, below.
llama.cpp's side needs llama-cpp-python (the `bench` extra pins 0.3.36). Build it for this CPU:
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36
into this interpreter or into a virtualenv of its own (then pass --llama-python
/that/venv/bin/python). Without it the llama.cpp column is skipped and said so.

Columns, per side:
  * cold start: process start -> first token, s (a fresh process each round: for shardserve
    `shardserve generate "Hi" --max-tokens 1` with the side's flags, to its first output line;
    for llama.cpp a python process that imports llama_cpp, loads the file and completes 1 token);
  * batch-1 decode, tok/s: one greedy request, the tokens after the first over the time they
    took (EOS banned / ignored, so every run decodes --decode-tokens);
  * 64 x 128, tok/s: 64 prompts x 128 tokens in one generate call; llama.cpp serves one
    sequence at a time here, so its figure comes from --llama-requests of the 64 prompts run one
    after another (the rate does not depend on how many).
Every round measures every side and column back to back (the sides' order rotating); ratios are
per round, reported as the median (and range) of the per-round ratios. Issue 14's targets:
batch-1 >= 1.2x llama.cpp, 64 x 128 >= 8x llama.cpp, cold start <= 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _real_size import first_line_time, run_real, shardserve_cold_start
from _rounds import Rounds, make_prompts, rotated, spread, timed

from shardserve import LLM, SamplingParams
from shardserve.model.loader import default_model_path

SIDES = {  # side -> LLM / CLI options
    "gguf": {"quantization": "gguf", "dtype": "auto"},
    "none-bf16": {"quantization": "none", "dtype": "bfloat16"},
    "none-f32": {"quantization": "none", "dtype": "float32"},
    "int8": {"quantization": "int8", "dtype": "auto"},
    "gguf-layerwise": {"quantization": "gguf", "dtype": "auto"},
    "gguf-nodense": {"quantization": "gguf", "dtype": "auto"},
    "gguf-x8": {"quantization": "gguf", "dtype": "auto"},
    "gguf-noamx": {"quantization": "gguf", "dtype": "auto"},
    "gguf-kvbf16": {"quantization": "gguf", "dtype": "auto", "kv_cache_dtype": "bfloat16"},
}
# Sides that differ by a tuning knob: gguf with its decode steps layer by layer from Python
# instead of one C call through the stack (model/fused_decode.py), to show what that call gains.
# gguf-nodense: without the dense weight copy that steps of 4+ rows use (matmul_layer.py).
# gguf-x8: the row kernels with int8 activations (csrc/quant_rows_int8.c; opt-in, less precise).
# gguf-noamx: the GEMM's bfloat16 products on AVX-512 where AMX would take them (quant_gemm_amx.c).
# gguf-kvbf16: gguf with its KV cache in bfloat16 (kv_cache_dtype; float32 activations' cache at
# half the bytes).
SIDE_ENV = {"gguf-layerwise": {"SHARDSERVE_FUSED_DECODE": "0"},
            "gguf-nodense": {"SHARDSERVE_QUANT_DENSE_BATCHES": "0"},
            "gguf-x8": {"SHARDSERVE_INT8_ACTIVATIONS": "1"},
            "gguf-noamx": {"SHARDSERVE_AMX": "0"}}
# torch's own instruction-set caps, each read at its first use (ATen's first dispatch, MKL's
# and oneDNN's first call), so setting them in main() covers in-process and child sides alike:
# at --isa avx2 on an AVX-512 CPU its flash attention's sgemm ran AVX-512 code otherwise (~2% of
# a 1B's 512-token prefill on a Xeon, 2026-12-08).
TORCH_ISA_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "portable": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                 "ONEDNN_MAX_CPU_ISA": "SSE41"},
}
LLAMA = "llama.cpp"
COLUMNS = ("cold start s", "batch-1 tok/s", "64x128 tok/s")
_LLAMA_COLD = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[2]), verbose=False)
llm.create_completion("Hi", max_tokens=1)
print("first token", flush=True)
"""


class ShardserveSide:
    def __init__(self, name: str, model: str, threads: int) -> None:
        self.name, self.model, self.options = name, model, SIDES[name]
        self.env = SIDE_ENV.get(name, {})
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:  # the knob is read when the model first decodes
            self.llm = LLM(model, max_model_len=1024, max_num_seqs=64, **self.options)
            self.llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
        self.threads = threads

    def cold_start(self) -> float:
        return shardserve_cold_start(self.model, self.options, self.env)

    def decode_rate(self, prompt: str, tokens: int) -> float:
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        full = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        t1 = timed(lambda: self.llm.generate([prompt], one, use_tqdm=False))
        tn = timed(lambda: self.llm.generate([prompt], full, use_tqdm=False))
        return (tokens - 1) / max(tn - t1, 1e-9)

    def throughput(self, prompts: list[str], tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)

    def close(self) -> None:
        self.llm.shutdown()


class LlamaSide:
    """llama-cpp-python in a child process (bench/_llamacpp_side.py)."""

    name = LLAMA

    def __init__(self, python: str, model: str, threads: int, requests: int) -> None:
        self.python, self.model, self.threads, self.requests = python, model, threads, requests
        here = Path(__file__).with_name("_llamacpp_side.py")
        self.proc = subprocess.Popen([python, str(here), model, str(threads)], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._read()

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp side exited ({self.proc.wait()})")
        return json.loads(line)

    def _ask(self, **cmd) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def cold_start(self) -> float:
        return first_line_time([self.python, "-c", _LLAMA_COLD, self.model, str(self.threads)],
                               "first token")

    def decode_rate(self, prompt: str, tokens: int) -> float:
        reply = self._ask(cmd="decode", prompt=prompt, tokens=tokens)
        return reply["tokens"] / reply["seconds"]

    def throughput(self, prompts: list[str], tokens: int) -> float:
        reply = self._ask(cmd="requests", prompts=prompts[: self.requests], tokens=tokens)
        return reply["tokens"] / reply["seconds"]

    def close(self) -> None:
        try:
            self._ask(cmd="quit")
        except (RuntimeError, BrokenPipeError, OSError):
            pass
        self.proc.kill()
        self.proc.wait()


def llama_available(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, timeout=120)
    return probe.returncode == 0


def measure_round(sides: list, r: int, args, prompts: list[str], samples: Rounds) -> None:
    for side in rotated(sides, r):
        samples.add((side.name, COLUMNS[0]), side.cold_start())
        samples.add((side.name, COLUMNS[1]), side.decode_rate(prompts[0], args.decode_tokens))
        samples.add((side.name, COLUMNS[2]), side.throughput(prompts, args.tokens))


def report(samples: Rounds, names: list[str], has_llama: bool) -> None:
    header = f"{'side':<12}" + "".join(f"{c:>16}" for c in COLUMNS)
    if has_llama:
        header += "   batch-1 / llama.cpp   64x128 / llama.cpp"
    print("\n" + header)
    for name in names:
        row = f"{name:<12}" + "".join(f"{samples.median((name, c)):>16.2f}" for c in COLUMNS)
        if has_llama and name != LLAMA:
            for col in COLUMNS[1:]:
                ratios = samples.ratios((name, col), (LLAMA, col))
                row += f"   {samples.ratio((name, col), (LLAMA, col)):.2f}x {spread(ratios):<12}"
        print(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sides", default="gguf,none-bf16,int8")
    parser.add_argument("--llama-python", default=sys.executable)
    parser.add_argument("--llama-requests", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--isa", choices=("native", "avx2", "portable"), default="native",
                        help="SHARDSERVE_ISA; llama.cpp's bin-<isa> with --llama-bin")
    real = parser.add_argument_group("real-size table (--llama-bin or --table real)")
    real.add_argument("--table", choices=("classic", "real"), default=None,
                      help="default: real with --llama-bin, else classic")
    real.add_argument("--llama-bin", default=None,
                      help="build_llama_cpp.sh's output folder (holding bin-native, bin-avx2)")
    real.add_argument("--batches", default="1,8,32")
    real.add_argument("--npp", type=int, default=64, help="prompt tokens per sequence")
    real.add_argument("--ntg", type=int, default=64, help="decode steps per batch size")
    real.add_argument("--pp", type=int, default=512, help="prefill test's prompt tokens")
    real.add_argument("--tg", type=int, default=128, help="batch-1 decode test's tokens")
    real.add_argument("--llama-bench-reps", type=int, default=1, help="llama-bench's -r")
    real.add_argument("--plot", default=None, help="FILE.png: decode tok/s against batch size")
    args = parser.parse_args()
    model = args.model or str(default_model_path())
    os.environ["SHARDSERVE_ISA"] = args.isa
    os.environ.update(TORCH_ISA_ENV.get(args.isa, {}))
    os.environ.setdefault("SHARDSERVE_NUM_THREADS", str(args.threads))
    if (args.table or ("real" if args.llama_bin else "classic")) == "real":
        if args.sides == parser.get_default("sides"):
            args.sides = "gguf,gguf-nodense"
        run_real(args, SIDES, SIDE_ENV, model)
        return
    prompts = make_prompts(args.prompts)
    sides: list = [ShardserveSide(name, model, args.threads) for name in args.sides.split(",")]
    has_llama = llama_available(args.llama_python)
    if has_llama:
        sides.append(LlamaSide(args.llama_python, model, args.threads, args.llama_requests))
    else:
        print(f"llama.cpp column skipped: `import llama_cpp` fails in {args.llama_python}; "
              f"see this file's docstring for how to install it")
    samples = Rounds()
    try:
        for side in sides:  # warm-up
            side.decode_rate(prompts[0], 8)
        for r in range(args.rounds):
            measure_round(sides, r, args, prompts, samples)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        for side in sides:
            side.close()
    report(samples, [s.name for s in sides], has_llama)


if __name__ == "__main__":
    main()
