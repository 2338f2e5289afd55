"""Fixtures of the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

# Sharded three ways (6 heads, 3 KV heads), as tests/engine/test_structured_outputs.py's model.
TP3 = dict(hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=3)


@pytest.fixture(scope="session")
def echo_model(tmp_path_factory, tiny_model_builder) -> Path:
    """A tiny tied random Llama (TP3's shape) whose layers' outputs are scaled down (o_proj
    and down_proj x 0.1): the residual stream stays near the token's own embedding, so a token
    mostly predicts itself (p(t | t ...) up to ~0.5, 0.19 on average). The speculative decoding
    tests use it: n-gram drafts of a repeated token are accepted about half of the time."""
    folder = tiny_model_builder("LlamaForCausalLM", tmp_path_factory.mktemp("echo"), tie=True,
                                **TP3)
    weights = load_file(folder / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.1
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
