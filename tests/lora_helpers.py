"""LoRA adapters made by HF's own `peft` (the oracle's library), and peft's greedy output.

    make_peft_adapter(hf_model, folder, rank=8, seed=1)   # adapter_config.json +
                                                          # adapter_model.safetensors, as peft
                                                          # saves them
    peft_greedy(hf_model, folder, prompt_ids, n)          # HF generate through the adapter

peft initialises B to zero (an adapter that changes nothing: a test with it could not fail),
so every A and B is drawn here from a seeded generator instead: A ~ N(0, 1/in), B ~ N(0, b_std),
enough to change greedy outputs (tests assert that they do). The caller's model is never
modified: peft wraps a deep copy.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(hf_model: Any, folder: Path, *, rank: int = 8, alpha: int | None = None,
                      targets: Iterable[str] | str = ALL_SEVEN, seed: int = 1,
                      b_std: float = 0.05, use_rslora: bool = False,
                      **config: Any) -> Path:
    """Save a random non-zero adapter for `hf_model` into `folder`; `config` goes to peft's
    LoraConfig as is (e.g. modules_to_save=["lm_head"] to make one that must be refused)."""
    return make_peft_model(hf_model, folder, rank=rank, alpha=alpha, targets=targets, seed=seed,
                           b_std=b_std, use_rslora=use_rslora, **config)[0]


def make_peft_model(hf_model: Any, folder: Path, *, rank: int = 8, alpha: int | None = None,
                    targets: Iterable[str] | str = ALL_SEVEN, seed: int = 1,
                    b_std: float = 0.05, use_rslora: bool = False,
                    **config: Any) -> tuple[Path, Any]:
    """make_peft_adapter, also returning peft's model that saved it (a deep copy of hf_model
    with the adapter: what peft_model(hf_model, folder) would load, without loading it)."""
    import torch
    from peft import LoraConfig, get_peft_model

    target_modules = targets if isinstance(targets, str) else list(targets)
    lora_config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=0.0,
                             target_modules=target_modules, use_rslora=use_rslora,
                             init_lora_weights=False, task_type="CAUSAL_LM", **config)
    model = get_peft_model(copy.deepcopy(hf_model), lora_config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                a.copy_(torch.randn(a.shape, generator=g) / a.shape[1] ** 0.5)
                b.copy_(torch.randn(b.shape, generator=g) * b_std)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    return folder, model.eval()


def edit_adapter_config(folder: Path, **changes: Any) -> Path:
    """Rewrite fields of a saved adapter_config.json (to make adapters that must be refused)."""
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
    return folder


def peft_model(hf_model: Any, folder: Path) -> Any:
    """A deep copy of `hf_model` with the adapter in `folder`, as peft runs it."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(hf_model), str(folder)).eval()


def peft_greedy(model: Any, prompt_ids: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations (n tokens, EOS ignored) of a peft_model, one prompt at a time."""
    import torch

    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            ref = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False)
            out.append(ref[0, len(ids):].tolist())
    return out
