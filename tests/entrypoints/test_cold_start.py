"""Cold start (issue 14): `shardserve generate "Hi" --max-tokens 1` in a fresh process.

Real subprocess runs on the default model with the user's cache (compiled kernels, tokenizer).
No wall-clock assertion beyond a timeout that catches hangs: bench/cold_start.py measures it.
What is asserted is what keeps it short: nothing on the way to the first token imports
transformers once the tokenizer cache is warm.
"""

from __future__ import annotations

import subprocess
import sys

HANG_TIMEOUT_S = 120  # a first run may compile the native kernels; a cold start is ~2 s


def run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=HANG_TIMEOUT_S)


def test_generate_one_token_from_a_fresh_process(default_model_path) -> None:
    proc = run([sys.executable, "-m", "shardserve", "generate", "Hi", "--max-tokens", "1"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:3] == ["--- prompt 1 ---", "Hi", "--- output 1 (finish_reason=length) ---"]
    assert len(lines) == 4 and lines[3].strip()  # the token
    assert "output_tokens=1 " in proc.stderr


def test_import_shardserve_does_not_import_transformers() -> None:
    proc = run([sys.executable, "-c", "import sys, shardserve, shardserve.entrypoints.cli\n"
                "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers'}))"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_first_token_without_transformers_once_cached(default_model_path) -> None:
    script = (
        "import sys\n"
        "from shardserve import LLM, SamplingParams\n"
        "llm = LLM()\n"
        "out = llm.generate('The capital of France is', SamplingParams(max_tokens=2,"
        " temperature=0), use_tqdm=False)[0]\n"
        "print(any(m.split('.')[0] == 'transformers' for m in sys.modules))\n"
        "print(out.prompt_token_ids, out.outputs[0].token_ids)\n"
        "print(out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt))\n"
        "llm.shutdown()\n"
    )
    run([sys.executable, "-c", script])  # warms the tokenizer cache if it is cold
    proc = run([sys.executable, "-c", script])
    assert proc.returncode == 0, proc.stderr
    imported, ids, same = proc.stdout.splitlines()
    assert imported == "False"
    assert ids.startswith("[504, 3575, 282, 4649, 314] ")
    assert same == "True"  # and the full tokenizer, built after, encodes the prompt the same
