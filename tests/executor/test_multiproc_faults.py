"""Failures of the mp backend surface fast and leave nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from fault_helpers import generate_until_dead

from shardserve import LLM, EngineDeadError, SamplingParams

pytestmark = pytest.mark.usefixtures("no_leftovers")

LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Hello, world! How are"] * 4


def _llm(path, **kwargs) -> LLM:
    options = dict(dtype="float32", max_model_len=256, tensor_parallel_size=2)
    options.update(kwargs)
    return LLM(str(path), **options)


def _worker_pid(llm: LLM, rank: int) -> int:
    return llm.engine.core.executor.workers[rank].pid


def test_sigkill_of_a_worker_during_generate(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    calls = []
    llm.engine.core.executor.register_failure_callback(lambda: calls.append(1))
    pid = _worker_pid(llm, 1)
    killed_at = []

    def kill_soon() -> None:
        time.sleep(0.5)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill_soon).start()
    try:
        with pytest.raises(EngineDeadError) as err:
            generate_until_dead(llm, PROMPTS * 4, LONG)
        detected = time.monotonic() - killed_at[0]
        print(f"SIGKILL detected after {detected * 1000:.0f} ms")
        assert detected < 5
        for word in ("rank 1", f"pid {pid}", "SIGKILL"):
            assert word in str(err.value)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            llm.generate(["again"], LONG, use_tqdm=False)
        assert time.monotonic() - t0 < 0.5
        with pytest.raises(EngineDeadError):
            llm.engine.core.executor.check_health()
        assert calls == [1]
    finally:
        llm.shutdown()
    # The pytest process can still build an engine.
    assert _llm(tiny_llama_dir, tensor_parallel_size=1).generate("ok", use_tqdm=False)


def test_exception_on_a_non_output_rank(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, worker_cls="faulty_worker.FaultyWorker")
    try:
        llm.collective_rpc("arm_fault", args=([1],))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="injected fault on rank 1") as err:
            llm.generate(PROMPTS, LONG, use_tqdm=False)
        elapsed = time.monotonic() - t0
        print(f"non-output rank exception surfaced after {elapsed * 1000:.0f} ms")
        assert elapsed < 1.0
        assert "worker rank 1" in str(err.value)
        assert "Traceback" in str(err.value.__cause__) and "execute_model" in str(
            err.value.__cause__
        )
    finally:
        llm.shutdown()


def test_worker_failing_at_start_up(tiny_llama_dir):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        _llm(tiny_llama_dir, worker_cls="faulty_worker.BrokenWeightsWorker")
    elapsed = time.monotonic() - t0
    print(f"start-up failure raised after {elapsed:.1f} s")
    assert elapsed < 5 + 10  # 5 s after the workers start; model loading itself takes seconds
    message = str(err.value)
    for word in ("rank 1", "pid", "FileNotFoundError", "rank1-weights.safetensors"):
        assert word in message


def test_stopped_worker_times_out_naming_method_and_rank(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, execute_timeout_s=2.0)
    pid = _worker_pid(llm, 1)
    try:
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as err:
            llm.generate(PROMPTS, LONG, use_tqdm=False)
        assert 1.5 < time.monotonic() - t0 < 10
        message = str(err.value)
        assert "execute_model" in message and f"rank 1 (pid {pid}) is stopped" in message
    finally:
        os.kill(pid, signal.SIGCONT)
        llm.shutdown()


ENGINE_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from shardserve import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], dtype="float32", max_model_len=256, tensor_parallel_size=2)
        print(" ".join(str(w.pid) for w in llm.engine.core.executor.workers), flush=True)
        while True:
            llm.generate(["The quick brown fox"] * 8, SamplingParams(max_tokens=50), use_tqdm=False)
    """
)


def _pids_gone(pids: list[int], timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def test_sigkill_of_the_engine_process_takes_its_workers(tiny_llama_dir, tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tiny_llama_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(0.5)
        proc.kill()
        proc.wait(timeout=5)
        gone = _pids_gone(pids, 5)
        print(f"workers gone {gone} s after the engine's SIGKILL")
        assert gone is not None and gone < 2
    finally:
        proc.kill()


def test_sigint_during_cli_generate_ends_the_process_tree(tiny_llama_dir):
    cmd = [sys.executable, "-m", "shardserve", "generate", "--model", str(tiny_llama_dir),
           "--tensor-parallel-size", "2", "--max-model-len", "256", "--max-tokens", "200",
           "--ignore-eos", *["The quick brown fox"] * 64]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    generating = threading.Event()

    def read_stderr() -> None:
        for line in iter(lambda: proc.stderr.read(64), ""):
            stderr.append(line)
            if "Generating" in "".join(stderr[-3:]):
                generating.set()

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        assert generating.wait(timeout=90), "".join(stderr)[-2000:]
        workers = [
            c
            for c in psutil.Process(proc.pid).children(recursive=True)
            if "Worker_TP" in " ".join(c.cmdline())
        ]
        assert len(workers) == 2
        time.sleep(0.5)  # into generate
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        proc.wait(timeout=10)
        gone = _pids_gone([w.pid for w in workers], 5)
        elapsed = time.monotonic() - t0
        print(f"process tree gone {elapsed:.2f} s after SIGINT")
        assert gone is not None and elapsed < 5
        assert proc.returncode == 130, "".join(stderr)[-2000:]
    finally:
        proc.kill()


def test_shutdown_twice_and_from_two_threads(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    executor = llm.engine.core.executor
    threads = [threading.Thread(target=executor.shutdown) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    executor.shutdown()
    llm.shutdown()
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(EngineDeadError):
        executor.collective_rpc("get_rank")
