"""Model loader: paths, architecture, weights and tokenizer, for HF folders and GGUF files.

The default-model checks compare against transformers' own (slow, offline) GGUF loading, which
is the reference for the Q/K permutation and the tokenizer build.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import transformers

from shardserve.config.model_arch import ModelArch
from shardserve.model.loader import (
    ModelNotFoundError,
    iter_weights,
    load_tokenizer,
    read_arch,
    resolve_model_path,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "  leading and trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "日本語のテキストと中文",
    "Ünïcödé àccénts: naïve café, Straße, Ελληνικά, русский",
    "emoji 🤖🎉👍🏽 and flags 🇫🇷",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { x[i] = i * 2; }",
    "numbers 1234567890 3.14159 -42 1e-5 2024-06-01",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<repo_name>more<file_sep>",
    "don't won't I'm they're we'll you've",
    "URL https://example.com/path?q=1&r=2#frag",
    "mixed CASE Words AND ALLCAPS",
    "a" * 50,
    "      \n      indented block",
    "Ġ literal byte-level chars Ċ",
]
MESSAGES = [{"role": "user", "content": "Write a haiku about tensors."}]
MESSAGES_SYS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye 👋"},
]


# ------------------------------------------------------------------ default GGUF model


@pytest.fixture(scope="module")
def hf_gguf_model(hf_default_model) -> dict[str, torch.Tensor]:
    """transformers' own float32 load of the default GGUF (shared by the session)."""
    return hf_default_model.state_dict()


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(default_model_path: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name
    )


def test_default_resolves_to_packaged_gguf(default_model_path: Path) -> None:
    assert resolve_model_path(None) == default_model_path
    assert default_model_path.suffix == ".gguf" and default_model_path.is_file()
    assert resolve_model_path(str(default_model_path)) == default_model_path


def test_default_gguf_arch(default_model_path: Path) -> None:
    arch = read_arch(default_model_path)
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.hidden_size, arch.intermediate_size, arch.num_layers) == (576, 1536, 30)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (9, 3, 64)
    assert arch.vocab_size == 49152
    assert arch.rope_theta == 100000.0 and arch.rope_scaling is None
    assert arch.rms_norm_eps == pytest.approx(1e-5)
    assert arch.tie_word_embeddings and not arch.attention_bias
    assert arch.max_position_embeddings == 8192
    assert arch.bos_token_id == 1 and arch.eos_token_ids == (2,)
    assert arch.valid_tp_sizes(8) == [1, 3]


def test_default_gguf_weights_match_transformers(default_model_path, hf_gguf_model) -> None:
    ours = dict(iter_weights(default_model_path))
    expected = {k: v for k, v in hf_gguf_model.items() if k != "lm_head.weight"}
    assert set(ours) == set(expected)
    for name, ref in expected.items():
        got = ours[name]
        assert got.dtype == torch.float32 and got.shape == ref.shape, name
        if not torch.equal(got, ref):  # exact in practice; allow float noise only
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-6, msg=name)
    assert sum(t.numel() for t in ours.values()) == 134_515_008


def test_gguf_tokenizer_matches_transformers(default_model_path, hf_gguf_tokenizer) -> None:
    ours = load_tokenizer(default_model_path)
    ref = hf_gguf_tokenizer
    assert isinstance(ours, transformers.PreTrainedTokenizerFast)
    assert len(ours) == len(ref) == 49152
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.all_special_ids == ref.all_special_ids
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids) == text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        )
    assert ours("hi there")["input_ids"][0] != ours.bos_token_id  # SmolLM2 adds no BOS
    for messages in (MESSAGES, MESSAGES_SYS):
        text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "You are a helpful AI assistant named SmolLM" in ours.apply_chat_template(
        MESSAGES, tokenize=False
    )


def test_default_model_load_times(default_model_path: Path) -> None:
    """Not a tight bound: prints the cold(ish) times; fails only on gross regressions."""
    from shardserve.model import gguf_loader

    gguf_loader._read_cached.cache_clear()
    t0 = time.perf_counter()
    read_arch(default_model_path)
    t1 = time.perf_counter()
    n = sum(1 for _ in iter_weights(default_model_path))
    t2 = time.perf_counter()
    load_tokenizer(default_model_path)
    t3 = time.perf_counter()
    print(
        f"\ndefault model: arch {t1 - t0:.3f}s, weights {t2 - t1:.3f}s ({n} tensors), "
        f"tokenizer {t3 - t2:.3f}s"
    )
    assert t1 - t0 < 5 and t2 - t1 < 20 and t3 - t2 < 10


# ------------------------------------------------------------------ HF folders


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_hf_folder_round_trip(fixture: str, request: pytest.FixtureRequest) -> None:
    folder: Path = request.getfixturevalue(fixture)
    assert resolve_model_path(folder) == folder
    config = json.loads((folder / "config.json").read_text())
    arch = read_arch(folder)
    assert arch.architecture == config["architectures"][0]
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads) == (64, 2, 8, 4)
    assert arch.head_dim == 8 and arch.intermediate_size == 128
    assert arch.vocab_size == config["vocab_size"] >= 300
    assert arch.attention_bias == (arch.architecture == "Qwen2ForCausalLM")
    assert arch.tie_word_embeddings == (arch.architecture == "Qwen2ForCausalLM")
    assert arch.rms_norm_eps == 1e-6 and arch.max_position_embeddings == 512
    assert arch.bos_token_id == 1 and arch.eos_token_ids == (2,)

    model_cls = getattr(transformers, arch.architecture)
    reference = model_cls.from_pretrained(folder, dtype=torch.float32).state_dict()
    ours = dict(iter_weights(folder))
    if arch.tie_word_embeddings:
        reference.pop("lm_head.weight")
    assert set(ours) == set(reference)
    for name, ref in reference.items():
        assert torch.equal(ours[name], ref), name
    assert any(name.endswith("q_proj.bias") for name in ours) == arch.attention_bias

    tok = load_tokenizer(folder)
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert len(tok) == arch.vocab_size and tok.eos_token_id == 2
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|im_start|>user\n") and chat.endswith("<|im_start|>assistant\n")


def _write_config(folder: Path, **overrides) -> Path:
    """A minimal config.json (no weights needed for read_arch when tie_word_embeddings is set)."""
    config = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        eos_token_id=[2, 7],
        bos_token_id=1,
    )
    config.update(overrides)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_rope_legacy_form(tmp_path: Path) -> None:
    folder = _write_config(
        tmp_path, rope_theta=500000.0, rope_scaling={"type": "llama3", **LLAMA3_SCALING}
    )
    arch = read_arch(folder)
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == {"rope_type": "llama3", **LLAMA3_SCALING}
    assert arch.eos_token_ids == (2, 7) and arch.head_dim == 8


def test_rope_parameters_form(tmp_path: Path) -> None:
    params = {"rope_theta": 500000.0, "rope_type": "llama3", **LLAMA3_SCALING}
    arch = read_arch(_write_config(tmp_path / "scaled", rope_parameters=params, head_dim=16))
    assert arch.rope_theta == 500000.0 and arch.head_dim == 16
    assert arch.rope_scaling == {"rope_type": "llama3", **LLAMA3_SCALING}
    plain = {"rope_theta": 1e6, "rope_type": "default"}
    arch = read_arch(_write_config(tmp_path / "plain", rope_parameters=plain))
    assert arch.rope_theta == 1e6 and arch.rope_scaling is None


def test_rope_parameters_from_transformers_config(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=2,
        intermediate_size=128,
        max_position_embeddings=16384,
        rope_scaling={"rope_type": "llama3", **LLAMA3_SCALING},
        rope_theta=500000.0,
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(tmp_path)
    arch = read_arch(tmp_path)
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == {"rope_type": "llama3", **LLAMA3_SCALING}


# ------------------------------------------------------------------ errors


def _assert_names(excinfo: pytest.ExceptionInfo, path: Path, *words: str) -> None:
    message = str(excinfo.value)
    assert str(path) in message, message
    for word in words:
        assert word in message, message


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError) as excinfo:
        resolve_model_path(missing)
    assert isinstance(excinfo.value, ModelNotFoundError)
    _assert_names(excinfo, missing, "config.json", ".gguf")


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as excinfo:
        resolve_model_path(tmp_path)
    _assert_names(excinfo, tmp_path, "config.json", ".gguf")


def test_unknown_file_type(tmp_path: Path) -> None:
    text = tmp_path / "model.txt"
    text.write_text("not a model")
    with pytest.raises(ValueError) as excinfo:
        resolve_model_path(text)
    _assert_names(excinfo, text, "config.json", ".gguf")


@pytest.mark.parametrize("keep", [0, 3, 64, 100_000, 5_000_000])
def test_corrupt_gguf(tmp_path: Path, default_model_path: Path, keep: int) -> None:
    bad = tmp_path / "broken.gguf"
    with open(default_model_path, "rb") as src:
        bad.write_bytes(src.read(keep))
    assert resolve_model_path(bad) == bad  # the suffix is fine; reading is what fails
    for action in (read_arch, lambda p: next(iter_weights(p)), load_tokenizer):
        with pytest.raises(ValueError) as excinfo:
            action(bad)
        _assert_names(excinfo, bad)
    with pytest.raises(ValueError) as excinfo:
        read_arch(bad)
    _assert_names(excinfo, bad, "LlamaForCausalLM", ".gguf")


def test_gguf_with_garbage_magic(tmp_path: Path) -> None:
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"\x00" * 4096)
    with pytest.raises(ValueError) as excinfo:
        read_arch(bad)
    _assert_names(excinfo, bad, "magic", "Qwen2ForCausalLM")


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    folder = _write_config(tmp_path, architectures=["GPT2LMHeadModel"])
    assert resolve_model_path(folder) == folder
    with pytest.raises(ValueError) as excinfo:
        read_arch(folder)
    _assert_names(excinfo, folder, "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM")


def test_copied_gguf_reads_same_arch(tmp_path: Path, default_model_path: Path) -> None:
    """A renamed copy parses to the same facts (the metadata cache is keyed per file)."""
    copy = shutil.copy(default_model_path, tmp_path / "copy.GGUF")
    assert read_arch(resolve_model_path(copy)) == read_arch(default_model_path)
    assert isinstance(read_arch(default_model_path), ModelArch)


def test_hf_index_and_inferred_tie(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """Only files named by the shard index are read, and a config without tie_word_embeddings
    is tied exactly when the checkpoint has no lm_head.weight."""
    from safetensors.torch import save_file

    folder = Path(shutil.copytree(tiny_llama_dir, tmp_path / "m"))
    expected = dict(iter_weights(tiny_llama_dir))
    weight_map = dict.fromkeys(expected, "model.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file({"bogus": torch.zeros(2)}, str(folder / "consolidated.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    del config["tie_word_embeddings"]
    (folder / "config.json").write_text(json.dumps(config))
    assert not read_arch(folder).tie_word_embeddings
    assert set(dict(iter_weights(folder))) == set(expected)

    config["tie_word_embeddings"] = True  # a tied config never yields lm_head.weight
    (folder / "config.json").write_text(json.dumps(config))
    assert "lm_head.weight" not in dict(iter_weights(folder))
