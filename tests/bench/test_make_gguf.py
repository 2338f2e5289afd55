"""bench/make_gguf.py: the shape table, and a very small shape written F16 that shardserve loads
and generates from (the real sizes are for the benches, not the suite)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from shardserve import LLM, SamplingParams
from shardserve.model.gguf_loader import gguf_arch, read_gguf
from shardserve.model.loader import default_model_path

_PATH = Path(__file__).resolve().parents[2] / "bench" / "make_gguf.py"
_spec = importlib.util.spec_from_file_location("make_gguf", _PATH)
assert _spec is not None and _spec.loader is not None
make_gguf = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("make_gguf", make_gguf)  # its dataclass looks itself up there
_spec.loader.exec_module(make_gguf)


def test_shape_table_is_llamas():
    s = make_gguf.SHAPES
    assert (s["1b"].hidden, s["1b"].layers, s["1b"].heads, s["1b"].kv_heads, s["1b"].ffn) == (
        2048, 16, 32, 8, 8192)
    assert (s["3b"].hidden, s["3b"].layers, s["3b"].heads, s["3b"].kv_heads, s["3b"].ffn) == (
        3072, 28, 24, 8, 8192)
    assert (s["8b"].hidden, s["8b"].layers, s["8b"].heads, s["8b"].kv_heads, s["8b"].ffn) == (
        4096, 32, 32, 8, 14336)
    # Llama 3.2 1B's layers, an untied head and the 49,152-token vocabulary: 1.17 B.
    assert make_gguf.parameter_count(s["1b"], 49152) == pytest.approx(1.174e9, rel=0.001)


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "small.gguf"
    argv = ["--shape", "1b", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads",
            "2", "--ffn", "128", "--out", str(out), "--seed", "3"]
    assert make_gguf.main(argv) == out
    return out


def test_small_shape_metadata_and_tensors(small_gguf):
    gf, _ = read_gguf(small_gguf)
    src, _ = read_gguf(default_model_path())
    for key, value in src.metadata.items():
        if key.startswith("tokenizer."):
            assert gf.metadata[key] == value, key
    arch = gguf_arch(small_gguf)
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads,
            arch.intermediate_size, arch.vocab_size) == (64, 2, 4, 2, 128, 49152)
    assert arch.rope_theta == 500000.0 and not arch.tie_word_embeddings
    names = [t.name for t in gf.tensors]
    assert names == [n for n, _ in make_gguf.tensor_plan(make_gguf.parse_shape(
        make_gguf.argparse.Namespace(shape="1b", hidden=64, layers=2, heads=4, kv_heads=2,
                                     ffn=128)), 49152)]


def test_small_shape_generates(small_gguf):
    llm = LLM(model=str(small_gguf), max_model_len=64, max_num_seqs=1)
    try:
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        out = llm.generate(["Hello"], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
