"""vLLM-style scripts run unchanged but for the import: examples/llm_engine_example.py (EngineArgs
from the command line, LLMEngine stepped by hand; on the tiny model) and
examples/structured_outputs.py (on the default model)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"


def _run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_llm_engine_example(tiny_llama_dir):
    out = _run("llm_engine_example.py", "--model", str(tiny_llama_dir), "--dtype", "float32",
               "--max-model-len", "128", "--max-num-seqs", "8")
    assert out.count("RequestOutput(request_id=") == 3
    assert "prompt_logprobs=[None, {" in out


@pytest.mark.slow
def test_structured_outputs_example(default_model_path):
    out = _run("structured_outputs.py", "--max-model-len", "512")
    lines = dict(line.split(": ", 1) for line in out.strip().splitlines())
    assert eval(lines["choice"]) in ("Positive", "Negative")  # noqa: S307 - our repr
    assert re.fullmatch(r"\w{1,20}@\w{1,20}\.com\n", eval(lines["regex"]))  # noqa: S307
    assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ",
                        eval(lines["grammar"]))  # noqa: S307
