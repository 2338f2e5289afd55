"""llama.cpp's own binaries (../shared/bench/build_llama_cpp.sh) as a side of
bench/cpu_vs_llamacpp.py's real-size table, and the machine figures measured beside it.

Per round, at `-t THREADS`:
  * `llama-bench -p PP -n TG -r REPS -o jsonl`: pp (tok/s of one PP-token batch) and tg (TG
    tokens decoded one at a time); its peak resident memory (ru_maxrss of that child, from
    os.wait4: weights mapped or repacked, KV cache and compute buffers) is the side's RSS and
    peak (llama.cpp loads everything up front; shardserve's dense copies may come later);
  * `llama-batched-bench -npp NPP -ntg NTG -npl B1,B2,.. --output-format jsonl`: decode tok/s
    per batch size (speed_tg = B x NTG / T_TG); its spawn-to-exit time less the timed parts
    (T_PP + T_TG of every B) is the load time: model load, context, a 16-token warm-up, exit
    (with jsonl output it prints no llama_perf_context_print to read);
  * cold start: `llama-batched-bench -c 512 -npp 1 -ntg 1 -npl 1` from spawn to exit (load,
    warm-up, one prompt token and one generated token); shardserve's gets the same context.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardserve.model.kernel_levels import cpu_flags

COLD_CTX = 512  # context of both sides' cold starts


def run_child(cmd: list[str], env: dict[str, str] | None = None) -> tuple[str, str, float, float]:
    """(stdout, stderr, seconds from spawn to exit, peak RSS in MiB) of one child."""
    with tempfile.TemporaryFile(mode="w+") as err_file:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file, text=True,
                                env={**os.environ, **(env or {})})
        assert proc.stdout is not None
        out = proc.stdout.read()  # to EOF; the child is reaped below, by wait4, for its rusage
        _, status, usage = os.wait4(proc.pid, 0)
        err_file.seek(0)
        err = err_file.read()
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{Path(cmd[0]).name} exited {proc.returncode}: {err[-2000:]}"
                           + _amx_hint(proc.returncode))
    return out, err, seconds, usage.ru_maxrss / 1024


def _amx_hint(returncode: int) -> str:
    """How to get past llama.cpp's native build crashing on an AMX CPU (SIGSEGV in its AMX
    matrix multiply, ggml-org/llama.cpp#20824): the same source built without AMX."""
    if returncode >= 0 or "amx_int8" not in cpu_flags():
        return ""
    return ("\nThis CPU has AMX, where llama.cpp's native build crashes (ggml-org/llama.cpp#20824)."
            " Build its native side without AMX: cmake -DGGML_NATIVE=OFF -DCMAKE_C_FLAGS="
            "'-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16' (the same for "
            "CMAKE_CXX_FLAGS), the other options as build_llama_cpp.sh passes them, and put "
            "llama-bench and llama-batched-bench in bin-native.")


def _jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


class LlamaBinSide:
    name = "llama.cpp"

    def __init__(self, bin_dir: Path, model: str, threads: int, pp: int, tg: int, npp: int,
                 ntg: int, batches: list[int], reps: int) -> None:
        self.bin_dir, self.model, self.threads = bin_dir, model, threads
        self.pp, self.tg, self.npp, self.ntg, self.batches, self.reps = (
            pp, tg, npp, ntg, batches, reps)
        for tool in ("llama-bench", "llama-batched-bench"):
            if not (bin_dir / tool).exists():
                raise FileNotFoundError(f"{bin_dir / tool} missing: build it with "
                                        f"../shared/bench/build_llama_cpp.sh")

    def _tool(self, name: str) -> str:
        return str(self.bin_dir / name)

    def measure(self) -> dict:
        t = str(self.threads)
        out, _, _, rss = run_child([self._tool("llama-bench"), "-m", self.model, "-p", str(self.pp),
                                    "-n", str(self.tg), "-t", t, "-r", str(self.reps),
                                    "-o", "jsonl"])
        result: dict = {"rss_mb": rss, "peak_mb": rss, "decode": {}}
        for row in _jsonl(out):
            if row["n_prompt"] > 0 and row["n_gen"] == 0:
                result["pp"] = row["avg_ts"]
            elif row["n_gen"] > 0 and row["n_prompt"] == 0:
                result["tg"] = row["avg_ts"]
        ctx = max(self.batches) * (self.npp + self.ntg)
        out, _, wall, _ = run_child([
            self._tool("llama-batched-bench"), "-m", self.model, "-c", str(ctx), "-b", "2048",
            "-ub", "512", "-npp", str(self.npp), "-ntg", str(self.ntg),
            "-npl", ",".join(map(str, self.batches)), "-t", t, "--output-format", "jsonl"])
        timed = 0.0
        for row in _jsonl(out):
            result["decode"][str(row["pl"])] = row["speed_tg"]
            timed += row["t_pp"] + row["t_tg"]
        result["load_s"] = wall - timed
        return result

    def cold_start(self) -> float:
        _, _, seconds, _ = run_child([self._tool("llama-batched-bench"), "-m", self.model,
                                      "-c", str(COLD_CTX), "-npp", "1", "-ntg", "1", "-npl", "1",
                                      "-t", str(self.threads)])
        return seconds

    def close(self) -> None:
        pass


_BANDWIDTH = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
x = torch.ones(int(sys.argv[2]) // 4, dtype=torch.float32)
best = float("inf")
for _ in range(6):
    t0 = time.perf_counter(); x.sum().item(); best = min(best, time.perf_counter() - t0)
print(x.numel() * 4 / best / 1e9)
"""


def read_bandwidth_gbs(threads: int, nbytes: int = 2 << 30) -> float:
    """GB/s of a torch sum over a float32 buffer far larger than cache (2 GiB), at `threads`
    threads, best of 6 passes, in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _BANDWIDTH, str(threads), str(nbytes)],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def import_torch_s() -> float:
    """Seconds from spawn to exit of a bare `python -c "import torch"`."""
    _, _, seconds, _ = run_child([sys.executable, "-c", "import torch"])
    return seconds


def weight_bytes_per_token(model: str) -> int:
    """Bytes of weights a batch-1 decode step reads: every tensor in the file as stored
    (quantized blocks included) except the token embedding, of which one row is read (unless
    the file has no output.weight: then the embedding is also the LM head and counts whole)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from shardserve.model.gguf_loader import read_gguf

    gf, _ = read_gguf(Path(model))
    names = {t.name for t in gf.tensors}
    total = 0
    for t in gf.tensors:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
        nbytes = int(np.prod(t.shape, dtype=np.int64)) // block * size
        if t.name == "token_embd.weight" and "output.weight" in names:
            nbytes //= t.shape[0]
        total += nbytes
    return total
