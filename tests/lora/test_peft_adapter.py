"""lora/peft_adapter.py on adapters saved by peft itself (tests/lora_helpers.py): what is read
(rank, scaling, rsLoRA, the modules peft's target_modules forms select, the tensors as saved),
and every refusal, each naming its field or layer and the fix."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from lora_helpers import edit_adapter_config, make_peft_adapter
from safetensors.torch import load_file, save_file

from shardserve.config.model_arch import ModelArch
from shardserve.lora.peft_adapter import PROJECTIONS, LoRAError, load_peft_adapter
from shardserve.model.loader import read_arch

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def arch(tiny_llama_dir: Path) -> ModelArch:
    return read_arch(tiny_llama_dir)


@pytest.fixture(scope="module")
def r8(hf, tmp_path_factory) -> Path:
    return make_peft_adapter(hf, tmp_path_factory.mktemp("r8") / "a", rank=8, alpha=16)


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy"))


def test_reads_what_peft_saved(r8: Path, arch: ModelArch) -> None:
    adapter = load_peft_adapter(r8, arch, max_lora_rank=16)
    assert (adapter.rank, adapter.scaling) == (8, 2.0)
    assert set(adapter.modules) == {(i, n) for i in range(2) for n in PROJECTIONS}
    saved = load_file(r8 / WEIGHTS)
    for (layer, name), mod in adapter.modules.items():
        key = f"base_model.model.model.layers.{layer}.{PROJECTIONS[name]}.{name}"
        assert torch.equal(mod.a, saved[f"{key}.lora_A.weight"])
        assert torch.equal(mod.b, saved[f"{key}.lora_B.weight"])
        assert mod.scaling == 2.0 and mod.b.abs().min() > 0  # random non-zero B
    only = load_peft_adapter(r8, arch, max_lora_rank=8, layers=[1])  # a pipeline stage's
    assert {layer for layer, _ in only.modules} == {1}


def test_rslora_scaling(hf, arch: ModelArch, tmp_path: Path) -> None:
    folder = make_peft_adapter(hf, tmp_path / "rs", rank=16, alpha=8, use_rslora=True)
    adapter = load_peft_adapter(folder, arch, max_lora_rank=16)
    assert adapter.scaling == pytest.approx(8 / math.sqrt(16))
    assert all(m.scaling == pytest.approx(2.0) for m in adapter.modules.values())


@pytest.mark.parametrize("targets, want", [
    ("all-linear", set(PROJECTIONS)),
    (r".*\.(q_proj|v_proj)", {"q_proj", "v_proj"}),
    (["model.layers.0.self_attn.q_proj", "mlp.down_proj"], {"q_proj", "down_proj"}),
], ids=["all_linear", "regex", "paths"])
def test_target_module_forms(targets, want: set[str], hf, arch: ModelArch,
                             tmp_path: Path) -> None:
    folder = make_peft_adapter(hf, tmp_path / "t", rank=4, targets=targets)
    adapter = load_peft_adapter(folder, arch, max_lora_rank=16)
    assert {name for _, name in adapter.modules} == want
    if isinstance(targets, list):
        assert (1, "q_proj") not in adapter.modules  # only layer 0's q_proj was named


def test_all_linear_written_by_hand_is_accepted(r8: Path, arch: ModelArch,
                                                tmp_path: Path) -> None:
    folder = edit_adapter_config(copy_of(r8, tmp_path), target_modules="all-linear")
    assert len(load_peft_adapter(folder, arch, 16).modules) == 14


@pytest.mark.parametrize("config, match", [
    (dict(modules_to_save=["lm_head"]), r"modules_to_save=\['lm_head'\] is not supported"),
    (dict(targets=["embed_tokens", "q_proj"]), r"target_modules=.* adapts model\.embed_tokens"),
    (dict(targets=["lm_head", "q_proj"]), r"target_modules=.* adapts lm_head"),
    (dict(use_dora=True), r"use_dora=True is not supported: DoRA"),
], ids=["modules_to_save", "embedding", "lm_head", "dora"])
def test_refused_adapters_made_by_peft(config: dict, match: str, hf, arch: ModelArch,
                                       tmp_path: Path) -> None:
    folder = make_peft_adapter(hf, tmp_path / "bad", rank=4, **config)
    with pytest.raises(LoRAError, match=match):
        load_peft_adapter(folder, arch, max_lora_rank=16)


@pytest.mark.parametrize("changes, match", [
    (dict(bias="all"), r"bias='all' is not supported"),
    (dict(lora_bias=True), r"lora_bias=True is not supported"),
    (dict(peft_type="IA3"), r"peft_type='IA3': only LORA"),
    (dict(r=4), r"adapter layer model\.layers\.0\.\w+\.\w+ has rank 8 but "
                r"adapter_config\.json says r=4"),
    (dict(rank_pattern={"q_proj": 32}), r"LoRA rank 32 is greater than max_lora_rank 16"),
    (dict(target_modules=None), r"target_modules is missing"),
    (dict(layer_replication=[[0, 2]]), r"layer_replication=.* is not supported"),
], ids=["bias", "lora_bias", "peft_type", "rank_disagrees", "rank_pattern", "no_targets",
        "layer_replication"])
def test_refused_config_fields(changes: dict, match: str, r8: Path, arch: ModelArch,
                               tmp_path: Path) -> None:
    folder = edit_adapter_config(copy_of(r8, tmp_path), **changes)
    with pytest.raises(LoRAError, match=match):
        load_peft_adapter(folder, arch, max_lora_rank=16)


def test_rank_over_max_lora_rank(r8: Path, arch: ModelArch) -> None:
    with pytest.raises(LoRAError, match=r"LoRA rank 8 is greater than max_lora_rank 4: start "
                                        r"the engine with max_lora_rank=8 or more"):
        load_peft_adapter(r8, arch, max_lora_rank=4)


def _other_model(hf, **changes):
    import transformers

    cfg = hf.config.to_dict() | changes
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()


def test_adapter_of_another_model(hf, arch: ModelArch, tmp_path: Path) -> None:
    """Another width: refused naming the first layer that does not fit and both shapes."""
    wider = make_peft_adapter(_other_model(hf, intermediate_size=96), tmp_path / "w", rank=4)
    with pytest.raises(LoRAError, match=r"adapter layer model\.layers\.0\.mlp\.down_proj does "
                                        r"not fit the base model: lora_A is \[4, 96\] and "
                                        r"lora_B \[64, 4\], the base down_proj needs lora_A "
                                        r"\[r, 128\] and lora_B \[64, r\]"):
        load_peft_adapter(wider, arch, max_lora_rank=16)
    deeper = make_peft_adapter(_other_model(hf, num_hidden_layers=3), tmp_path / "d", rank=4,
                               targets=["v_proj"])
    with pytest.raises(LoRAError, match=r"for layer 2, but the base model has 2 layers"):
        load_peft_adapter(deeper, arch, max_lora_rank=16)


def test_weights_file_contents(r8: Path, arch: ModelArch, tmp_path: Path) -> None:
    folder = copy_of(r8, tmp_path)
    saved = load_file(folder / WEIGHTS)
    # peft on a bare LlamaModel (no causal-LM wrapper) drops one "model.": the same adapter.
    save_file({k.replace("model.model.", "model."): v for k, v in saved.items()},
              folder / WEIGHTS)
    assert load_peft_adapter(folder, arch, 16).modules.keys() == \
        load_peft_adapter(r8, arch, 16).modules.keys()
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    save_file({k: v for k, v in saved.items() if k != key}, folder / WEIGHTS)
    with pytest.raises(LoRAError, match=r"model\.layers\.1\.mlp\.up_proj has no lora_B"):
        load_peft_adapter(folder, arch, 16)
    save_file(saved | {"base_model.model.model.embed_tokens.lora_embedding_A":
                       torch.zeros(8, arch.vocab_size)}, folder / WEIGHTS)
    with pytest.raises(LoRAError, match=r"embed_tokens\.lora_embedding_A: embedding adapters "
                                        r"are not supported"):
        load_peft_adapter(folder, arch, 16)
    save_file(saved | {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
                       torch.ones(64)}, folder / WEIGHTS)
    with pytest.raises(LoRAError, match=r"DoRA \(use_dora\) is not supported"):
        load_peft_adapter(folder, arch, 16)


def test_missing_or_broken_files(r8: Path, arch: ModelArch, tmp_path: Path) -> None:
    with pytest.raises(LoRAError, match=r"lora_path='/nonexistent/adapter' is not a folder"):
        load_peft_adapter("/nonexistent/adapter", arch, 16)
    folder = copy_of(r8, tmp_path)
    (folder / WEIGHTS).rename(folder / "adapter_model.bin")
    with pytest.raises(LoRAError, match=r"has no adapter_model\.safetensors \(only safetensors"):
        load_peft_adapter(folder, arch, 16)
    (folder / "adapter_model.bin").write_bytes(b"not safetensors")
    (folder / "adapter_model.bin").rename(folder / WEIGHTS)
    with pytest.raises(LoRAError, match=r"is not a readable safetensors file"):
        load_peft_adapter(folder, arch, 16)
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match=r"adapter_config\.json is not readable JSON"):
        load_peft_adapter(folder, arch, 16)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(LoRAError, match=r"has no adapter_config\.json"):
        load_peft_adapter(folder, arch, 16)
    assert issubclass(LoRAError, ValueError)
