"""EngineTokenizer: the engine's encode and detokenizing backend, from a cache for GGUF files,
with the transformers tokenizer built only when asked for. Checked against `load_tokenizer`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from shardserve.model.loader import load_tokenizer
from shardserve.model.tokenizer import EngineTokenizer, _backend_cache_file

TEXTS = [
    "Hi",
    "The capital of France is",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces\t\ttabs\n\nnewlines  ",
    "héllo wörld 日本語 🤖 ½",
    "<|endoftext|>after a special token",
    "don't I'll we're 12345 3.14159",
    "a" * 300,
]


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SHARDSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_cached_backend_encodes_as_the_transformers_tokenizer(default_model_path, cache_dir):
    first = EngineTokenizer(default_model_path)  # a miss: builds the full tokenizer, caches
    assert first._full is not None
    assert _backend_cache_file(default_model_path).is_file()
    cached = EngineTokenizer(default_model_path)
    assert cached._full is None  # a hit: nothing built
    ref = load_tokenizer(default_model_path)
    for text in TEXTS:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special)
            assert cached.encode(text, add_special_tokens=special) == ids
            assert first.encode(text, add_special_tokens=special) == ids
            assert cached._tokenizer.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    assert cached.clean_up_tokenization_spaces == ref.clean_up_tokenization_spaces
    assert cached._full is None


def test_full_is_built_on_first_use(default_model_path, cache_dir):
    EngineTokenizer(default_model_path)
    tok = EngineTokenizer(default_model_path)
    ref = load_tokenizer(default_model_path)
    assert tok.decode([504, 3575, 282], skip_special_tokens=True) == ref.decode([504, 3575, 282])
    assert type(tok.full) is type(ref)
    assert tok.full is tok.full
    assert tok.full.chat_template == ref.chat_template


def test_unreadable_cache_entry_is_rebuilt(default_model_path, cache_dir):
    EngineTokenizer(default_model_path)
    file = _backend_cache_file(default_model_path)
    file.write_text("{not json", encoding="utf-8")
    tok = EngineTokenizer(default_model_path)
    assert tok._full is not None  # built again...
    entry = json.loads(file.read_text(encoding="utf-8"))  # ...and the entry rewritten
    assert Tokenizer.from_str(entry["backend"]).encode("Hi").ids == tok.encode("Hi")


def test_another_or_changed_model_file_misses_the_cache(default_model_path, cache_dir, tmp_path):
    link = tmp_path / "link.gguf"
    link.symlink_to(default_model_path)
    assert _backend_cache_file(link) == _backend_cache_file(default_model_path)  # same file
    copy = tmp_path / "model.gguf"
    shutil.copyfile(default_model_path, copy)
    before = _backend_cache_file(copy)
    assert before != _backend_cache_file(default_model_path)
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert _backend_cache_file(copy) != before


def test_hf_folder_is_not_cached(tiny_model_builder, cache_dir, tmp_path):
    folder = tiny_model_builder("LlamaForCausalLM", tmp_path / "tiny")
    tok = EngineTokenizer(folder)
    assert tok._full is not None
    assert not (cache_dir / "tokenizers").exists()
    ref = load_tokenizer(folder)
    assert tok.encode("Hello, world!") == ref.encode("Hello, world!")


def test_cache_hit_does_not_import_transformers(default_model_path, cache_dir):
    EngineTokenizer(default_model_path)
    script = (
        "import sys\n"
        "from shardserve.model.tokenizer import EngineTokenizer\n"
        f"tok = EngineTokenizer({str(default_model_path)!r})\n"
        "print(tok.encode('The capital of France is'))\n"
        "print(any(m.split('.')[0] == 'transformers' for m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=120).stdout.splitlines()
    assert out[0] == str(load_tokenizer(default_model_path).encode("The capital of France is"))
    assert out[1] == "False"
