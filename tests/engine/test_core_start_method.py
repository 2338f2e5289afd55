"""Engine cores start as the mp workers do (executor/start_method.py): a user's plain script,
without an `if __name__ == "__main__":` guard, runs with tensor_parallel_size=3 (workers forked)
and with data_parallel_size=2 as well (engine cores forked, and each forks its workers from the
thread its work runs on), and prints what its guarded version prints (run once, with both:
greedy outputs do not depend on the layout, as the TP and DP tests show)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import TP3  # heads that split three ways

pytestmark = pytest.mark.usefixtures("no_leftovers")

# A parallel torch kernel first, so the parent's OpenMP pool exists when the children fork.
BODY = """\
import sys
import torch
a = torch.randn(256, 256)
a @ a
from shardserve import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_model_len=64, {options})
params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
for out in llm.generate(["hello there", "one two three", "a b c"], params, use_tqdm=False):
    print("TOKENS", out.outputs[0].token_ids)
llm.shutdown()
"""



@pytest.fixture(scope="module")
def tp3_model(tmp_path_factory, tiny_model_builder) -> Path:
    return tiny_model_builder("LlamaForCausalLM", tmp_path_factory.mktemp("tp3_dp"), **TP3)


def _run(folder: Path, model: Path, options: str, guarded: bool) -> list[str]:
    body = BODY.format(options=options)
    if guarded:
        body = 'if __name__ == "__main__":\n' + textwrap.indent(body, "    ")
    script = folder / ("guarded.py" if guarded else "plain.py")
    script.write_text(body)
    env = {k: v for k, v in os.environ.items() if k != "SHARDSERVE_WORKER_MULTIPROC_METHOD"}
    proc = subprocess.run([sys.executable, str(script), str(model)], capture_output=True,
                          text=True, timeout=300, cwd=folder, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "spawn" not in proc.stderr, proc.stderr[-3000:]  # forked: no start-method warning
    tokens = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(tokens) == 3, proc.stdout
    return tokens


@pytest.fixture(scope="module")
def guarded_tokens(tmp_path_factory, tp3_model) -> list[str]:
    folder = tmp_path_factory.mktemp("guarded")
    return _run(folder, tp3_model, "data_parallel_size=2, tensor_parallel_size=3", guarded=True)


# data_parallel_size=2 alone was a case of its own: with both, the engine cores are forked
# from the script's main thread just as they are then (and their workers from the cores).
@pytest.mark.parametrize("options", [
    "tensor_parallel_size=3",
    "data_parallel_size=2, tensor_parallel_size=3",
])
def test_unguarded_script_prints_what_the_guarded_one_prints(tmp_path, tp3_model, options,
                                                             guarded_tokens):
    assert _run(tmp_path, tp3_model, options, guarded=False) == guarded_tokens


def test_unguarded_script_under_spawn_says_what_to_fix(tmp_path, tiny_llama_dir):
    script = tmp_path / "plain.py"
    script.write_text(BODY.format(options="data_parallel_size=2"))
    env = {**os.environ, "SHARDSERVE_WORKER_MULTIPROC_METHOD": "spawn"}
    proc = subprocess.run([sys.executable, str(script), str(tiny_llama_dir)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode != 0
    assert "plain.py:6 starts an engine at the top level" in proc.stderr, proc.stderr[-3000:]
    assert "exited during start-up" not in proc.stderr  # refused before any core started
