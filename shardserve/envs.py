"""Every environment variable shardserve reads: debug and tuning knobs only, `SHARDSERVE_` prefix.

Behaviour that a user configures lives in the typed configs (config.py) and travels to workers as
an argument; nothing here is used to ship configuration between processes. Values are read lazily
(at call time) so tests can set them per process.
"""

from __future__ import annotations

import os


def _get_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from e


def _get_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


def log_level() -> str:
    """SHARDSERVE_LOG_LEVEL: logging level of the `shardserve` logger (default INFO)."""
    return os.environ.get("SHARDSERVE_LOG_LEVEL", "INFO").upper()


def log_stats_interval_s() -> float:
    """SHARDSERVE_LOG_STATS_INTERVAL_S: how often the server logs its throughput line (10)."""
    return _get_float("SHARDSERVE_LOG_STATS_INTERVAL_S", 10.0)


def num_threads() -> int:
    """SHARDSERVE_NUM_THREADS: torch intra-op threads per worker (0 = torch's default)."""
    return int(_get_float("SHARDSERVE_NUM_THREADS", 0))


def rpc_stall_warning_s() -> float:
    """SHARDSERVE_RPC_STALL_WARNING_S: how often a waiting call logs the ranks it waits for."""
    return _get_float("SHARDSERVE_RPC_STALL_WARNING_S", 60.0)


def node_silent_s() -> float:
    """SHARDSERVE_NODE_SILENT_S: how long node 0 waits without a word from a ready headless node
    before it declares the node dead (2.5); a headless node gives up on node 0 after twice this.
    A node that dies is seen at once (its connection closes); this bound is for a hung agent or
    a cut network, and for machines so loaded that a 2.5-s stall is normal (the suite's nodes)."""
    return _get_float("SHARDSERVE_NODE_SILENT_S", 2.5)


# --- shardserve/ipc (MessageQueue) ---------------------------------------------------------------


def ipc_spin_us() -> float | None:
    """SHARDSERVE_IPC_SPIN_US: how long a MessageQueue side polls (yielding the core between
    looks) before blocking in the kernel; 0 blocks at once. Unset: 100 (see wakeup.py)."""
    raw = os.environ.get("SHARDSERVE_IPC_SPIN_US")
    return None if raw is None or raw == "" else _get_float("SHARDSERVE_IPC_SPIN_US", 0.0)


def ipc_recheck_ms() -> float:
    """SHARDSERVE_IPC_RECHECK_MS: longest single blocking wait before shared state is re-read."""
    return _get_float("SHARDSERVE_IPC_RECHECK_MS", 50.0)


def ipc_warn_interval_s() -> float:
    """SHARDSERVE_IPC_WARN_INTERVAL_S: how often a waiting queue side logs who it waits for."""
    return _get_float("SHARDSERVE_IPC_WARN_INTERVAL_S", 60.0)


def ipc_drop_notify() -> bool:
    """SHARDSERVE_IPC_DROP_NOTIFY: test switch; writers send no wake-ups (readers recheck only)."""
    return _get_bool("SHARDSERVE_IPC_DROP_NOTIFY", False)


def ipc_oob_threshold() -> int:
    """SHARDSERVE_IPC_OOB_THRESHOLD: pickle buffers of at least this many bytes go out-of-band."""
    return int(_get_float("SHARDSERVE_IPC_OOB_THRESHOLD", float(1 << 20)))


def host_ip() -> str | None:
    """SHARDSERVE_HOST_IP: address remote readers connect to when `connect_ip` is not given."""
    return os.environ.get("SHARDSERVE_HOST_IP") or None


def cluster_secret() -> str | None:
    """SHARDSERVE_CLUSTER_SECRET: the secret every TCP connection between shardserve processes
    proves knowledge of (CurveZMQ keys derived from it, ipc/curve_auth.py). Unset: each queue
    makes a random one, handed to its readers with the queue's handle."""
    return os.environ.get("SHARDSERVE_CLUSTER_SECRET") or None


def shm_allreduce() -> bool:
    """SHARDSERVE_SHM_ALLREDUCE: CPU tensor-parallel ranks on one machine sum through shared
    memory instead of gloo (default on; 0 to compare against gloo)."""
    return _get_bool("SHARDSERVE_SHM_ALLREDUCE", True)


# --- shardserve/model (native CPU kernels) -------------------------------------------------------


def native_kernels() -> bool:
    """SHARDSERVE_NATIVE_KERNELS: use the C CPU kernels (default on; 0 = the PyTorch path only)."""
    return _get_bool("SHARDSERVE_NATIVE_KERNELS", True)


ISA_LEVELS = ("native", "avx2", "portable")


def isa() -> str:
    """SHARDSERVE_ISA: the instruction-set level the C kernels are built at and loaded
    (model/kernel_levels.py): native (default; -march=native: AVX-512, VNNI, BF16 where the CPU
    has them), avx2 (-march=x86-64-v3: AVX2, FMA, F16C, no AVX-512) or portable
    (-march=x86-64-v2 on x86, no -march elsewhere: the plain C paths). Anything else is
    refused, naming the choices; avx2 on a CPU without it too (at the build)."""
    raw = os.environ.get("SHARDSERVE_ISA", "").strip().lower()
    if raw and raw not in ISA_LEVELS:
        raise ValueError(f"SHARDSERVE_ISA={raw!r} is not an ISA level: choose one of "
                         f"{', '.join(ISA_LEVELS)} (or leave it unset for native)")
    return raw or "native"


def quant_dense_batches() -> bool:
    """SHARDSERVE_QUANT_DENSE_BATCHES=1: with quantized weights, also keep a prepacked dense copy
    (the model's dtype) for steps past the row kernels' rows (opt-in: it costs the memory of the
    unquantized model, ~10x a Q4 file in float32; default off = the panel GEMM from the blocks,
    csrc/quant_gemm.c)."""
    return _get_bool("SHARDSERVE_QUANT_DENSE_BATCHES", False)


def int8_activations() -> bool:
    """SHARDSERVE_INT8_ACTIVATIONS=1: the row kernels (small batches, the batch-1 decode step)
    quantize x to int8 per 32 values instead of int16, as llama.cpp does: 1.1-2.2x faster rows on
    AVX2, at ~0.5% of a product's largest value as error (int16: ~0.002%), so greedy outputs can
    differ from the float model's. Default off. Weights the loader tiles (every tiled type:
    Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; on AVX2 the int16 tiles ran 1.2-1.7x these int8 rows) keep
    int16 (SHARDSERVE_TILES=0 hands them to the int8 rows)."""
    return _get_bool("SHARDSERVE_INT8_ACTIVATIONS", False)


def tiles() -> bool:
    """SHARDSERVE_TILES: quantized weights whose rows come in multiples of 16 are rewritten at
    load as tiles of 16 rows where the build has their kernels (model/quantization.py's
    repacked_type; default on; 0 = the file's layout, for comparison, or to have
    SHARDSERVE_INT8_ACTIVATIONS reach the types tiles would take)."""
    return _get_bool("SHARDSERVE_TILES", True)


def amx() -> bool:
    """SHARDSERVE_AMX: the batched products of bfloat16 x on Intel's AMX tiles where the CPU has
    AMX-BF16 and the kernel grants the tile state (csrc/quant_gemm_amx.c; default on; 0 = the
    AVX-512 vdpbf16ps panels, for comparison or where AMX misbehaves)."""
    return _get_bool("SHARDSERVE_AMX", True)


def huge_pages() -> bool:
    """SHARDSERVE_HUGE_PAGES: the weights products stream and the KV cache go into memory
    advised for 2 MiB pages (model/huge_pages.py; default on; 0 = 4 KiB pages, quantized
    weights left where they lie in the file's map where their layout allows)."""
    return _get_bool("SHARDSERVE_HUGE_PAGES", True)


def fused_decode() -> bool:
    """SHARDSERVE_FUSED_DECODE: run decode steps of quantized layers (fewer than 4 rows, one
    tensor-parallel rank) as one C call through the whole layer stack (default on; 0 = layer by
    layer from Python, the same kernels and results, ~2 ms slower a step on the default model)."""
    return _get_bool("SHARDSERVE_FUSED_DECODE", True)


def cache_dir() -> str:
    """SHARDSERVE_CACHE_DIR: where compiled kernels and GGUF tokenizer backends are kept
    (default ~/.cache/shardserve)."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "shardserve")
    return os.environ.get("SHARDSERVE_CACHE_DIR") or default


def compiler() -> str:
    """SHARDSERVE_CC: the C compiler that builds the native kernels (default gcc)."""
    return os.environ.get("SHARDSERVE_CC") or "gcc"


def worker_multiproc_method() -> str | None:
    """SHARDSERVE_WORKER_MULTIPROC_METHOD: how the mp backend starts workers: fork or spawn
    (default: fork while this process has no other threads and no CUDA context, else spawn)."""
    raw = os.environ.get("SHARDSERVE_WORKER_MULTIPROC_METHOD", "").strip().lower()
    if raw and raw not in ("fork", "spawn"):
        raise ValueError(
            f"SHARDSERVE_WORKER_MULTIPROC_METHOD={raw!r} must be 'fork' or 'spawn' (or unset)"
        )
    return raw or None


def api_key() -> str | None:
    """SHARDSERVE_API_KEY: the server's API key when --api-key is not given (keeps it out of
    `ps`). Unset: no key; set but empty: refused at start-up."""
    return os.environ.get("SHARDSERVE_API_KEY")
